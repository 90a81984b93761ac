"""GPT-2 (language-model head tied to the token embedding), with Hugging Face weights and a KV cache.

Pre-LayerNorm decoder with learned positions and the tanh GELU. Hugging Face stores GPT-2's
``Conv1D`` weights as (in, out), redcoast's kernel layout, so nothing is transposed. The fused
Q/K/V projection ``c_attn`` is kept as one kernel of shape (hidden, 3, hidden): its last axis holds
whole heads, so tensor parallelism splits it by heads (a 2-D (hidden, 3*hidden) kernel split on
its columns would cut across Q, K and V instead).
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from ..errors import ConfigError
from . import hf, stacked
from .activations import activation
from .blocks import packed_rows
from .layers import attend, attention_mask as slot_mask  # the argument's name is taken

# run settings, not the model's
_NOT_IN_HF = ("dtype", "remat", "scan_layers", "attention_implementation")


@dataclass(frozen=True)
class Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: Any = None  # None: 4 * n_embd
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    add_cross_attention: bool = False  # a decoder of a VisionEncoderDecoderModel
    bos_token_id: Any = 50256
    eos_token_id: Any = 50256
    dtype: Any = jnp.float32
    remat: bool = False
    scan_layers: bool = False  # the layers stacked and run by a scan (models/stacked.py)
    attention_implementation: Any = None  # None: per call (models/attention.py)

    def __post_init__(self):
        activation(self.activation_function, "activation_function")  # fail early if unknown
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}.")
        if self.scan_layers and self.scale_attn_by_inverse_layer_idx:
            raise ConfigError("scan_layers=True with scale_attn_by_inverse_layer_idx: each layer "
                              "scales its attention by its own index, and a scan runs one layer "
                              "for all. Fix: scan_layers=False for this model.")

    @property
    def inner_size(self):
        return self.n_inner or 4 * self.n_embd

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @classmethod
    def from_hf(cls, d):
        if d.get("tie_word_embeddings", True) is False:
            raise ConfigError("tie_word_embeddings=false: redcoast's GPT-2 ties its LM head to the "
                              "token embedding, as every released GPT-2 does.")
        names = {f.name for f in dataclasses.fields(cls)} - set(_NOT_IN_HF)
        return cls(**{k: d[k] for k in names if k in d})

    def to_hf(self):
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in _NOT_IN_HF}
        return {**d, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                "tie_word_embeddings": True,
                **({"is_decoder": True} if self.add_cross_attention else {})}


def _normal():
    return nnx.initializers.normal(0.02)


def _layer_norm(config, param_dtype, rngs):
    # Two-pass variance: E[x^2] - E[x]^2 loses digits the reference keeps.
    return nnx.LayerNorm(config.n_embd, epsilon=config.layer_norm_epsilon, dtype=config.dtype,
                         param_dtype=param_dtype, use_fast_variance=False, rngs=rngs)


def _linear(n_in, n_out, config, param_dtype, rngs):
    return nnx.Linear(n_in, n_out, dtype=config.dtype, param_dtype=param_dtype, rngs=rngs,
                      kernel_init=_normal())


class FusedQKV(nnx.Module):
    """x [B, T, hidden] -> q, k, v [B, T, heads, head_dim] from one (hidden, 3, hidden) kernel."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32, parts=3):
        self.config = config
        self.parts = parts  # 3: Q, K, V; 2: K, V (cross-attention)
        h = config.n_embd
        self.kernel = nnx.Param(_normal()(rngs.params(), (h, parts, h), param_dtype))
        self.bias = nnx.Param(jnp.zeros((parts, h), param_dtype))

    def __call__(self, x):
        c = self.config
        qkv = jnp.einsum("btd,dce->btce", x.astype(c.dtype), self.kernel[...].astype(c.dtype))
        qkv = qkv + self.bias[...].astype(c.dtype)
        qkv = qkv.reshape(*x.shape[:2], self.parts, c.n_head, c.head_dim)
        return tuple(qkv[:, :, i] for i in range(self.parts))


class CrossAttention(nnx.Module):
    """Attention of the text to an encoder's output: queries from ``q_attn``, keys and values
    from ``c_attn``, one (hidden, 2, hidden) kernel split by heads like the fused Q/K/V."""

    def __init__(self, config, layer_idx, *, rngs, param_dtype=jnp.float32):
        self.config = config
        h = config.n_embd
        self.q_attn = _linear(h, h, config, param_dtype, rngs)
        self.c_attn = FusedQKV(config, rngs=rngs, param_dtype=param_dtype, parts=2)
        self.c_proj = _linear(h, h, config, param_dtype, rngs)
        self.scale = Attention.attention_scale(config, layer_idx)

    def kv(self, encoder_hidden):
        """Keys and values [B, S, heads, head_dim] of the encoder output."""
        return self.c_attn(encoder_hidden)

    def __call__(self, x, k, v, mask):
        c = self.config
        q = self.q_attn(x).reshape(*x.shape[:2], c.n_head, c.head_dim)
        a = attend(q, k, v, mask, scale=self.scale, implementation=c.attention_implementation)
        return self.c_proj(a.reshape(*x.shape[:2], -1))


class Attention(nnx.Module):
    def __init__(self, config, layer_idx, *, rngs, param_dtype=jnp.float32):
        self.config = config
        self.c_attn = FusedQKV(config, rngs=rngs, param_dtype=param_dtype)
        self.c_proj = _linear(config.n_embd, config.n_embd, config, param_dtype, rngs)
        self.scale = self.attention_scale(config, layer_idx)
        self.implementation = config.attention_implementation

    @staticmethod
    def attention_scale(config, layer_idx):
        scale = config.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        return scale

    def __call__(self, x, mask, cache=None, cache_index=None):
        q, k, v = self.c_attn(x)
        if cache is not None:  # write this call's keys/values at their slots, attend over all
            start = (0, cache_index, 0, 0)
            cache = {"k": lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), start),
                     "v": lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), start)}
            k, v = cache["k"].astype(q.dtype), cache["v"].astype(q.dtype)
        # mask None: causal and unpadded, masked inside the kernel
        a = attend(q, k, v, mask, scale=self.scale, causal=mask is None,
                   implementation=self.implementation)
        return self.c_proj(a.reshape(*x.shape[:2], -1)), cache


class MLP(nnx.Module):
    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        self.config = config
        self.c_fc = _linear(config.n_embd, config.inner_size, config, param_dtype, rngs)
        self.c_proj = _linear(config.inner_size, config.n_embd, config, param_dtype, rngs)

    def __call__(self, x):
        return self.c_proj(activation(self.config.activation_function)(self.c_fc(x)))


class Block(nnx.Module):
    def __init__(self, config, layer_idx, *, rngs, param_dtype=jnp.float32):
        self.ln_1 = _layer_norm(config, param_dtype, rngs)
        self.attn = Attention(config, layer_idx, rngs=rngs, param_dtype=param_dtype)
        if config.add_cross_attention:
            self.ln_cross_attn = _layer_norm(config, param_dtype, rngs)
            self.crossattention = CrossAttention(config, layer_idx, rngs=rngs,
                                                 param_dtype=param_dtype)
        self.ln_2 = _layer_norm(config, param_dtype, rngs)
        self.mlp = MLP(config, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x, mask, cache=None, cache_index=None, cross_kv=None, cross_mask=None):
        a, cache = self.attn(self.ln_1(x), mask, cache, cache_index)
        x = x + a
        if cross_kv is not None:
            x = x + self.crossattention(self.ln_cross_attn(x), cross_kv["k"], cross_kv["v"],
                                        cross_mask)
        return x + self.mlp(self.ln_2(x)), cache


class GPT2LMHeadModel(nnx.Module):
    """``(input_ids, attention_mask=None, positions=None, cache=None, cache_index=None,
    segment_ids=None)`` -> logits [B, T, vocab] float32, or ``(logits, new_cache)`` with a cache
    (see ``init_cache``). ``segment_ids`` [B, T]: rows of packed sequences
    (:func:`redcoast.text.packing.pack_sequences`), each attending within itself, positions per
    sequence.

    With ``add_cross_attention`` (the text decoder of a VisionEncoderDecoderModel) every block
    also attends to an encoder's output: pass ``cross_kv`` (from :meth:`cross_kv`) and
    optionally ``cross_mask`` [B, 1, 1, S]."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        self.config = config
        embed = dict(dtype=config.dtype, param_dtype=param_dtype, rngs=rngs,
                     embedding_init=_normal())
        self.wte = nnx.Embed(config.vocab_size, config.n_embd, **embed)
        self.wpe = nnx.Embed(config.n_positions, config.n_embd, **embed)
        self.h = stacked.make_layers(
            lambda i, r: Block(config, i, rngs=r, param_dtype=param_dtype), config.n_layer, rngs,
            config.scan_layers)
        self.ln_f = _layer_norm(config, param_dtype, rngs)

    def init_cache(self, batch_size, max_length, dtype=jnp.float32):
        """Empty keys and values for ``max_length`` slots: {"layers": {"0": {"k", "v"}, ...}},
        each [batch, max_length, heads, head_dim]."""
        c = self.config
        if max_length > c.n_positions:
            raise ConfigError(f"max_length {max_length} exceeds GPT-2's n_positions "
                              f"{c.n_positions}; it has no position embedding beyond that.")
        shape = (batch_size, max_length, c.n_head, c.head_dim)
        return {"layers": {str(i): {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                           for i in range(c.n_layer)}}

    def cross_kv(self, encoder_hidden):
        """Every block's cross-attention keys and values of ``encoder_hidden`` [B, S, n_embd]:
        {"layers": {"i": {"k": [B, S, heads, head_dim], "v": ...}}}, computed once per input."""
        c = self.config
        x = encoder_hidden.astype(c.dtype)
        return {"layers": {str(i): dict(zip(("k", "v"), stacked.layer_of(
            self.h, i, c.scan_layers).crossattention.kv(x))) for i in range(c.n_layer)}}

    def __call__(self, input_ids, attention_mask=None, positions=None, cache=None,
                 cache_index=None, cross_kv=None, cross_mask=None, segment_ids=None):
        b, t = input_ids.shape
        if segment_ids is not None:
            key_valid, positions = packed_rows(segment_ids, attention_mask, positions, cache)
            slots = jnp.arange(t)
            mask = slot_mask(slots, slots, key_valid, segment_ids=segment_ids)
        elif cache is None:
            mask = None  # causal, unpadded: the attention kernel masks itself
            if attention_mask is not None:
                mask = (jnp.tril(jnp.ones((t, t), bool))[None, None]
                        & attention_mask.astype(bool)[:, None, None, :])
            if positions is None:
                positions = (jnp.broadcast_to(jnp.arange(t), (b, t)) if attention_mask is None
                             else jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0))
        else:
            if attention_mask is None or positions is None or cache_index is None:
                raise ConfigError("decoding with a cache needs attention_mask [B, max_length] over "
                                  "the cache slots, positions [B, T] and cache_index.")
            slots = jnp.arange(attention_mask.shape[1])
            query_slots = cache_index + jnp.arange(t)
            mask = ((slots[None, :] <= query_slots[:, None])[None, None]
                    & attention_mask.astype(bool)[:, None, None, :])
        c = self.config
        x, new_cache = stacked.run_layers(
            self.h, c.n_layer, self.wte(input_ids) + self.wpe(positions), cache,
            lambda block, h, layer_cache, layer_kv=None: block(h, mask, layer_cache, cache_index,
                                                               layer_kv, cross_mask),
            scanned=c.scan_layers, remat=c.remat, inputs=cross_kv)
        logits = self.wte.attend(self.ln_f(x)).astype(jnp.float32)
        return logits if cache is None else (logits, new_cache)


MODULES = {"GPT2LMHeadModel": GPT2LMHeadModel}
DEFAULT_MODULE = GPT2LMHeadModel


def hf_sources(config, module_cls, prefix=""):
    """Tensor names as transformers saves GPT2LMHeadModel (``prefix`` "decoder." inside a
    VisionEncoderDecoderModel); the tied head is ``wte``."""
    def conv1d(name):  # stored (in, out): no transpose
        return {"kernel": hf.Source(f"{name}.weight"), "bias": hf.Source(f"{name}.bias")}

    def fused(name, parts):  # stored (in, parts * out), kept (in, parts, out)
        h = config.n_embd
        return {"kernel": hf.Source(f"{name}.weight", shape=(h, parts * h)),
                "bias": hf.Source(f"{name}.bias", shape=(parts * h,))}

    def norm(name):
        return {"scale": hf.Source(f"{name}.weight"), "bias": hf.Source(f"{name}.bias")}

    def block(i):
        p = f"{prefix}transformer.h.{i}."
        out = {"ln_1": norm(p + "ln_1"), "ln_2": norm(p + "ln_2"),
               "attn": {"c_attn": fused(p + "attn.c_attn", 3), "c_proj": conv1d(p + "attn.c_proj")},
               "mlp": {"c_fc": conv1d(p + "mlp.c_fc"), "c_proj": conv1d(p + "mlp.c_proj")}}
        if config.add_cross_attention:
            out["ln_cross_attn"] = norm(p + "ln_cross_attn")
            out["crossattention"] = {"q_attn": conv1d(p + "crossattention.q_attn"),
                                     "c_attn": fused(p + "crossattention.c_attn", 2),
                                     "c_proj": conv1d(p + "crossattention.c_proj")}
        return out

    return {"wte": {"embedding": hf.Source(f"{prefix}transformer.wte.weight")},
            "wpe": {"embedding": hf.Source(f"{prefix}transformer.wpe.weight")},
            "h": stacked.layer_sources(block, config.n_layer, config.scan_layers),
            "ln_f": norm(f"{prefix}transformer.ln_f")}


def example_inputs(config, module_cls):
    ids = jax.ShapeDtypeStruct((2, min(8, config.n_positions)), jnp.int32)
    return ids, ids  # input_ids, attention_mask
