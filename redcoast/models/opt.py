"""OPT (facebook/opt-125m ... opt-66b) in Flax NNX, with Hugging Face weights and a KV cache.

A decoder with learned positions (two unused rows in front: position p reads row p + 2), ReLU
MLPs and biases everywhere (``enable_bias``). ``do_layer_norm_before`` picks pre-LN (most sizes;
with a final LayerNorm) or post-LN (opt-350m, without one). When ``word_embed_proj_dim`` differs
from ``hidden_size`` (opt-350m) the token embedding is narrower: ``project_in`` widens it and
``project_out`` narrows the output before the LM head, which is tied to the token embedding.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import ConfigError
from . import hf, stacked
from .activations import activation
from .blocks import (LearnedPositions, cached_attention, check_length, decoder_inputs, dense,
                     empty_kv_cache, layer_norm, merge_heads, split_heads)

POSITION_OFFSET = 2
# Config fields that say how redcoast runs the model, not what it is: not in config.json
_HOW_IT_RUNS = ("dtype", "remat", "scan_layers")


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 50272
    hidden_size: int = 768
    num_hidden_layers: int = 12
    ffn_dim: int = 3072
    max_position_embeddings: int = 2048
    do_layer_norm_before: bool = True
    remove_final_layer_norm: bool = False  # config.json's "_remove_final_layer_norm"
    word_embed_proj_dim: int | None = None  # None: hidden_size
    num_attention_heads: int = 12
    activation_function: str = "relu"
    init_std: float = 0.02
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    pad_token_id: Any = 1
    bos_token_id: Any = 2
    eos_token_id: Any = 2
    dtype: Any = jnp.float32
    remat: bool = False
    scan_layers: bool = False  # the layers stacked and run by a scan (models/stacked.py)

    def __post_init__(self):
        if self.word_embed_proj_dim is None:
            object.__setattr__(self, "word_embed_proj_dim", self.hidden_size)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        activation(self.activation_function, "activation_function")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not a multiple of "
                              f"num_attention_heads {self.num_attention_heads}.")

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    @property
    def projects(self):
        return self.word_embed_proj_dim != self.hidden_size

    @property
    def final_norm(self):
        return self.do_layer_norm_before and not self.remove_final_layer_norm

    @classmethod
    def from_hf(cls, d):
        if d.get("tie_word_embeddings", True) is False:
            raise ConfigError("tie_word_embeddings=false: redcoast's OPT ties its LM head to the "
                              "token embedding, as every released OPT does.")
        names = {f.name for f in dataclasses.fields(cls)} - {*_HOW_IT_RUNS,
                                                               "remove_final_layer_norm"}
        return cls(**{k: d[k] for k in names if k in d},
                   remove_final_layer_norm=d.get("_remove_final_layer_norm", False))

    def to_hf(self):
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in (*_HOW_IT_RUNS, "remove_final_layer_norm")}
        if isinstance(d["eos_token_id"], tuple):
            d["eos_token_id"] = list(d["eos_token_id"])
        return {**d, "_remove_final_layer_norm": self.remove_final_layer_norm,
                "model_type": "opt", "architectures": ["OPTForCausalLM"],
                "tie_word_embeddings": True, "dropout": 0.0, "attention_dropout": 0.0}


class OPTAttention(nnx.Module):
    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.config = c
        kw = dict(bias=c.enable_bias, dtype=c.dtype, param_dtype=param_dtype, rngs=rngs,
                  std=c.init_std)
        self.q_proj = dense(c.hidden_size, c.hidden_size, **kw)
        self.k_proj = dense(c.hidden_size, c.hidden_size, **kw)
        self.v_proj = dense(c.hidden_size, c.hidden_size, **kw)
        self.out_proj = dense(c.hidden_size, c.hidden_size, **kw)

    def __call__(self, x, key_valid, query_slots, cache=None, cache_index=None, segment_ids=None):
        c = self.config
        q, k, v = (split_heads(p(x), c.num_attention_heads)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y, cache = cached_attention(q, k, v, key_valid, query_slots, cache, cache_index,
                                    scale=c.head_dim ** -0.5, segment_ids=segment_ids)
        return self.out_proj(merge_heads(y)), cache


class OPTDecoderLayer(nnx.Module):
    """Pre-LN: ``x + attn(ln(x))``, ``x + mlp(ln(x))``; post-LN: ``ln(x + attn(x))``, ..."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.config = c
        norm = dict(affine=c.layer_norm_elementwise_affine, dtype=c.dtype,
                    param_dtype=param_dtype, rngs=rngs)
        kw = dict(bias=c.enable_bias, dtype=c.dtype, param_dtype=param_dtype, rngs=rngs,
                  std=c.init_std)
        self.self_attn = OPTAttention(c, rngs=rngs, param_dtype=param_dtype)
        self.self_attn_layer_norm = layer_norm(c.hidden_size, **norm)
        self.fc1 = dense(c.hidden_size, c.ffn_dim, **kw)
        self.fc2 = dense(c.ffn_dim, c.hidden_size, **kw)
        self.final_layer_norm = layer_norm(c.hidden_size, **norm)

    def __call__(self, x, key_valid, query_slots, cache=None, cache_index=None, segment_ids=None):
        pre = self.config.do_layer_norm_before
        h = self.self_attn_layer_norm(x) if pre else x
        a, cache = self.self_attn(h, key_valid, query_slots, cache, cache_index, segment_ids)
        x = x + a
        if not pre:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if pre else x
        x = x + self.fc2(activation(self.config.activation_function)(self.fc1(h)))
        return (x if pre else self.final_layer_norm(x)), cache


class OPTForCausalLM(nnx.Module):
    """``(input_ids, attention_mask=None, positions=None, cache=None, cache_index=None,
    segment_ids=None)`` -> logits [B, T, vocab] float32, or ``(logits, new_cache)`` with a
    cache (the protocol of :func:`redcoast.models.blocks.decoder_inputs`; ``segment_ids`` for
    packed rows)."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.config = c
        self.embed_tokens = nnx.Embed(c.vocab_size, c.word_embed_proj_dim, dtype=c.dtype,
                                      param_dtype=param_dtype, rngs=rngs,
                                      embedding_init=nnx.initializers.normal(c.init_std))
        self.embed_positions = LearnedPositions(c.max_position_embeddings, c.hidden_size,
                                                offset=POSITION_OFFSET, dtype=c.dtype,
                                                param_dtype=param_dtype, rngs=rngs, std=c.init_std)
        if c.projects:
            kw = dict(bias=False, dtype=c.dtype, param_dtype=param_dtype, rngs=rngs,
                      std=c.init_std)
            self.project_in = dense(c.word_embed_proj_dim, c.hidden_size, **kw)
            self.project_out = dense(c.hidden_size, c.word_embed_proj_dim, **kw)
        if c.scan_layers:
            self.layers = stacked.stacked_layers(
                lambda r: OPTDecoderLayer(c, rngs=r, param_dtype=param_dtype), c.num_hidden_layers,
                rngs)
        else:
            self.layers = nnx.List([OPTDecoderLayer(c, rngs=rngs, param_dtype=param_dtype)
                                    for _ in range(c.num_hidden_layers)])
        if c.final_norm:
            self.final_layer_norm = layer_norm(c.hidden_size, affine=c.layer_norm_elementwise_affine,
                                               dtype=c.dtype, param_dtype=param_dtype, rngs=rngs)

    def init_cache(self, batch_size, max_length, dtype=jnp.float32):
        """Empty keys and values: {"layers": {"0": {"k", "v"}, ...}}, each [B, S, heads, head_dim]."""
        c = self.config
        check_length(max_length, c.max_position_embeddings, "OPT")
        return empty_kv_cache(c.num_hidden_layers, batch_size, max_length,
                              c.num_attention_heads, c.head_dim, dtype)

    def __call__(self, input_ids, attention_mask=None, positions=None, cache=None,
                 cache_index=None, segment_ids=None):
        c = self.config
        positions, key_valid, query_slots = decoder_inputs(input_ids, attention_mask, positions,
                                                           cache, cache_index, segment_ids)
        x = self.embed_tokens(input_ids)
        if c.projects:
            x = self.project_in(x)
        x = x + self.embed_positions(positions)
        x, new_cache = stacked.run_layers(
            self.layers, c.num_hidden_layers, x, cache,
            lambda layer, h, layer_cache: layer(h, key_valid, query_slots, layer_cache,
                                                cache_index, segment_ids),
            scanned=c.scan_layers, remat=c.remat)
        if c.final_norm:
            x = self.final_layer_norm(x)
        if c.projects:
            x = self.project_out(x)
        logits = self.embed_tokens.attend(x).astype(jnp.float32)
        return logits if cache is None else (logits, new_cache)


MODULES = {"OPTForCausalLM": OPTForCausalLM}
DEFAULT_MODULE = OPTForCausalLM


def hf_sources(config, module_cls=OPTForCausalLM):
    """Tensor names as transformers saves OPTForCausalLM; the tied head is ``embed_tokens``."""
    c = config

    def linear(name, bias=c.enable_bias):
        out = {"kernel": hf.Source(f"{name}.weight", transpose=True)}
        return {**out, "bias": hf.Source(f"{name}.bias")} if bias else out

    def norm(name):
        if not c.layer_norm_elementwise_affine:
            return {}
        return {"scale": hf.Source(f"{name}.weight"), "bias": hf.Source(f"{name}.bias")}

    def layer(i):
        p = f"model.decoder.layers.{i}"
        return _without_empty({"self_attn": {n: linear(f"{p}.self_attn.{n}")
                              for n in ("q_proj", "k_proj", "v_proj", "out_proj")},
                "self_attn_layer_norm": norm(f"{p}.self_attn_layer_norm"),
                "fc1": linear(f"{p}.fc1"), "fc2": linear(f"{p}.fc2"),
                "final_layer_norm": norm(f"{p}.final_layer_norm")})

    out = {"embed_tokens": {"embedding": hf.Source("model.decoder.embed_tokens.weight")},
           "embed_positions": {"table": {"embedding": hf.Source(
               "model.decoder.embed_positions.weight")}},
           "layers": (hf.stack_sources([layer(i) for i in range(c.num_hidden_layers)])
                      if c.scan_layers else {str(i): layer(i) for i in range(c.num_hidden_layers)})}
    if c.projects:
        out["project_in"] = linear("model.decoder.project_in", bias=False)
        out["project_out"] = linear("model.decoder.project_out", bias=False)
    if c.final_norm:
        out["final_layer_norm"] = norm("model.decoder.final_layer_norm")
    return _without_empty(out)


def _without_empty(tree):
    """``tree`` without the entries of LayerNorms that have no parameters."""
    return {k: v for k, v in tree.items() if v != {}}


def example_inputs(config, module_cls=OPTForCausalLM):
    ids = jax.ShapeDtypeStruct((2, min(8, config.max_position_embeddings)), jnp.int32)
    return ids, ids  # input_ids, attention_mask
