"""GPT-J (e.g. EleutherAI/gpt-j-6b) in Flax NNX, with Hugging Face weights and a KV cache.

One LayerNorm per layer feeds attention and the MLP side by side: ``x + attn(ln(x)) + mlp(ln(x))``
(the "parallel" block). Rotary positions turn only the first ``rotary_dim`` dimensions of each
query and key head, pairing neighbouring dimensions (interleaved, unlike Llama's halves). The
Q/K/V/out projections have no bias; the LM head is a matrix of its own, with a bias.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import ConfigError
from . import hf, stacked
from .activations import activation
from .blocks import (cached_attention, check_length, decoder_inputs, dense, empty_kv_cache,
                     layer_norm, merge_heads, split_heads)
from .layers import apply_rotary, rotary_cos_sin

ROPE_THETA = 10000.0  # fixed in GPT-J
_HOW_IT_RUNS = ("dtype", "remat", "scan_layers")  # Config fields not in config.json


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 50400
    n_positions: int = 2048
    n_embd: int = 4096
    n_layer: int = 28
    n_head: int = 16
    rotary_dim: int | None = 64  # None: the whole head
    n_inner: int | None = None  # None: 4 * n_embd
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    bos_token_id: Any = 50256
    eos_token_id: Any = 50256
    pad_token_id: Any = None
    dtype: Any = jnp.float32
    remat: bool = False
    scan_layers: bool = False  # the layers stacked and run by a scan (models/stacked.py)

    def __post_init__(self):
        activation(self.activation_function, "activation_function")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}.")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or self.rotary_dim > self.head_dim):
            raise ConfigError(f"rotary_dim {self.rotary_dim} must be even and at most the head "
                              f"dimension {self.head_dim}.")

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def inner_size(self):
        return self.n_inner or 4 * self.n_embd

    @classmethod
    def from_hf(cls, d):
        if d.get("tie_word_embeddings", False):
            raise ConfigError("tie_word_embeddings=true: GPT-J's LM head is a matrix of its own "
                              "(with a bias) in every released checkpoint; redcoast does not tie it.")
        names = {f.name for f in dataclasses.fields(cls)} - set(_HOW_IT_RUNS)
        return cls(**{k: d[k] for k in names if k in d})

    def to_hf(self):
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in _HOW_IT_RUNS}
        return {**d, "model_type": "gptj", "architectures": ["GPTJForCausalLM"],
                "tie_word_embeddings": False}


class GPTJAttention(nnx.Module):
    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.config = c
        kw = dict(bias=False, dtype=c.dtype, param_dtype=param_dtype, rngs=rngs,
                  std=c.initializer_range)
        self.q_proj = dense(c.n_embd, c.n_embd, **kw)
        self.k_proj = dense(c.n_embd, c.n_embd, **kw)
        self.v_proj = dense(c.n_embd, c.n_embd, **kw)
        self.out_proj = dense(c.n_embd, c.n_embd, **kw)

    def __call__(self, x, cos, sin, key_valid, query_slots, cache=None, cache_index=None,
                 segment_ids=None):
        c = self.config
        q = apply_rotary(split_heads(self.q_proj(x), c.n_head), cos, sin, interleaved=True)
        k = apply_rotary(split_heads(self.k_proj(x), c.n_head), cos, sin, interleaved=True)
        v = split_heads(self.v_proj(x), c.n_head)
        y, cache = cached_attention(q, k, v, key_valid, query_slots, cache, cache_index,
                                    scale=c.head_dim ** -0.5, segment_ids=segment_ids)
        return self.out_proj(merge_heads(y)), cache


class GPTJMLP(nnx.Module):
    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        kw = dict(dtype=c.dtype, param_dtype=param_dtype, rngs=rngs, std=c.initializer_range)
        self.act = activation(c.activation_function)
        self.fc_in = dense(c.n_embd, c.inner_size, **kw)
        self.fc_out = dense(c.inner_size, c.n_embd, **kw)

    def __call__(self, x):
        return self.fc_out(self.act(self.fc_in(x)))


class GPTJBlock(nnx.Module):
    """``x + attn(ln_1(x)) + mlp(ln_1(x))``."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.ln_1 = layer_norm(c.n_embd, eps=c.layer_norm_epsilon, dtype=c.dtype,
                               param_dtype=param_dtype, rngs=rngs)
        self.attn = GPTJAttention(c, rngs=rngs, param_dtype=param_dtype)
        self.mlp = GPTJMLP(c, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x, cos, sin, key_valid, query_slots, cache=None, cache_index=None,
                 segment_ids=None):
        h = self.ln_1(x)
        a, cache = self.attn(h, cos, sin, key_valid, query_slots, cache, cache_index, segment_ids)
        return x + a + self.mlp(h), cache


class GPTJForCausalLM(nnx.Module):
    """``(input_ids, attention_mask=None, positions=None, cache=None, cache_index=None,
    segment_ids=None)`` -> logits [B, T, vocab] float32, or ``(logits, new_cache)`` with a
    cache (see ``init_cache`` and :func:`redcoast.models.blocks.decoder_inputs` for the
    protocol; ``segment_ids`` for packed rows)."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.config = c
        self.wte = nnx.Embed(c.vocab_size, c.n_embd, dtype=c.dtype, param_dtype=param_dtype,
                             embedding_init=nnx.initializers.normal(c.initializer_range), rngs=rngs)
        self.h = stacked.make_layers(
            lambda i, r: GPTJBlock(c, rngs=r, param_dtype=param_dtype), c.n_layer, rngs,
            c.scan_layers)
        self.ln_f = layer_norm(c.n_embd, eps=c.layer_norm_epsilon, dtype=c.dtype,
                               param_dtype=param_dtype, rngs=rngs)
        self.lm_head = dense(c.n_embd, c.vocab_size, dtype=c.dtype, param_dtype=param_dtype,
                             rngs=rngs, std=c.initializer_range)

    def init_cache(self, batch_size, max_length, dtype=jnp.float32):
        """Empty keys and values: {"layers": {"0": {"k", "v"}, ...}}, each [B, S, heads, head_dim]."""
        c = self.config
        check_length(max_length, c.n_positions, "GPT-J")
        return empty_kv_cache(c.n_layer, batch_size, max_length, c.n_head, c.head_dim, dtype)

    def __call__(self, input_ids, attention_mask=None, positions=None, cache=None,
                 cache_index=None, segment_ids=None):
        c = self.config
        positions, key_valid, query_slots = decoder_inputs(input_ids, attention_mask, positions,
                                                           cache, cache_index, segment_ids)
        cos, sin = rotary_cos_sin(positions, c.rotary_dim or c.head_dim, ROPE_THETA)
        x, new_cache = stacked.run_layers(
            self.h, c.n_layer, self.wte(input_ids), cache,
            lambda block, h, layer_cache: block(h, cos, sin, key_valid, query_slots, layer_cache,
                                                cache_index, segment_ids),
            scanned=c.scan_layers, remat=c.remat)
        logits = self.lm_head(self.ln_f(x)).astype(jnp.float32)
        return logits if cache is None else (logits, new_cache)


MODULES = {"GPTJForCausalLM": GPTJForCausalLM}
DEFAULT_MODULE = GPTJForCausalLM


def hf_sources(config, module_cls=GPTJForCausalLM):
    """Tensor names as transformers saves GPTJForCausalLM (PyTorch (out, in) kernels)."""
    def linear(name, bias=True):
        out = {"kernel": hf.Source(f"{name}.weight", transpose=True)}
        return {**out, "bias": hf.Source(f"{name}.bias")} if bias else out

    def norm(name):
        return {"scale": hf.Source(f"{name}.weight"), "bias": hf.Source(f"{name}.bias")}

    def block(i):
        p = f"transformer.h.{i}"
        return {"ln_1": norm(f"{p}.ln_1"),
                "attn": {n: linear(f"{p}.attn.{n}", bias=False)
                         for n in ("q_proj", "k_proj", "v_proj", "out_proj")},
                "mlp": {"fc_in": linear(f"{p}.mlp.fc_in"), "fc_out": linear(f"{p}.mlp.fc_out")}}

    return {"wte": {"embedding": hf.Source("transformer.wte.weight")},
            "h": stacked.layer_sources(block, config.n_layer, config.scan_layers),
            "ln_f": norm("transformer.ln_f"), "lm_head": linear("lm_head")}


def example_inputs(config, module_cls=GPTJForCausalLM):
    ids = jax.ShapeDtypeStruct((2, min(8, config.n_positions)), jnp.int32)
    return ids, ids  # input_ids, attention_mask
