"""Pieces the Hugging Face-style families share (GPT-J, OPT, BART, ViT): layer constructors,
learned position tables, the decoder-only call protocol and self-attention through a KV cache.

Attention itself is :func:`redcoast.models.layers.attend` (one place chooses how it runs); the
masks are :func:`redcoast.models.layers.attention_mask` for causal attention and
:func:`key_mask` for attention over every real key (encoders, cross-attention).
"""

import jax.numpy as jnp
from flax import nnx

from ..errors import ConfigError
from .layers import attend, attention_mask, segment_positions, write_cache


def dense(n_in, n_out, *, bias=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs, std=0.02):
    """``nnx.Linear`` with a (in, out) kernel drawn from N(0, std)."""
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=nnx.initializers.normal(std), rngs=rngs)


def layer_norm(dim, *, eps=1e-5, affine=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs):
    """LayerNorm as PyTorch computes it (two-pass variance: E[x^2] - E[x]^2 loses digits);
    ``affine=False`` has no scale and no bias (OPT's ``layer_norm_elementwise_affine``)."""
    return nnx.LayerNorm(dim, epsilon=eps, dtype=dtype, param_dtype=param_dtype,
                         use_fast_variance=False, use_scale=affine, use_bias=affine, rngs=rngs)


class LearnedPositions(nnx.Module):
    """A learned position table read at ``positions + offset`` (OPT and BART keep two unused rows
    in front, ``offset=2``)."""

    def __init__(self, n_positions, dim, *, offset=0, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs, std=0.02):
        self.n_positions = n_positions
        self.offset = offset
        self.table = nnx.Embed(n_positions + offset, dim, dtype=dtype, param_dtype=param_dtype,
                               embedding_init=nnx.initializers.normal(std), rngs=rngs)

    def __call__(self, positions):
        return self.table(positions + self.offset)


def check_length(max_length, n_positions, family):
    if max_length > n_positions:
        raise ConfigError(f"{max_length} positions exceed {family}'s max_position_embeddings "
                          f"{n_positions}; it has no position embedding beyond that. Fix: "
                          "shorten the prompt or max_new_tokens.")


def packed_rows(segment_ids, attention_mask, positions, cache):
    """``(attention_mask, positions)`` of rows of packed sequences
    (:func:`redcoast.text.packing.pack_sequences`): real where ``segment_ids`` is not 0, positions
    counted within each segment unless given. They replace an attention mask and take no
    cache."""
    if cache is not None or attention_mask is not None:
        raise ConfigError("segment_ids (packed sequences) replace attention_mask and do not go "
                          "with a cache. Fix: pass segment_ids alone for training on packed "
                          "rows; decode one sequence per row.")
    if positions is None:
        positions = segment_positions(segment_ids)
    return (segment_ids != 0).astype(jnp.int32), positions


def decoder_inputs(input_ids, attention_mask, positions, cache, cache_index, segment_ids=None):
    """``(positions [B, T], key_valid [B, S], query_slots [T])`` for a decoder-only call.

    Without a cache: ``attention_mask [B, T]`` (1 real, 0 padding; default all real) and
    positions counting the real tokens before each one (left padding works), or
    ``segment_ids`` of packed rows (:func:`packed_rows`). With one: ``attention_mask
    [B, S_max]`` marks the slots that hold (or now receive) real tokens, ``positions`` and
    ``cache_index`` (the slot of ``input_ids[:, 0]``) are required."""
    b, t = input_ids.shape
    if segment_ids is not None:
        attention_mask, positions = packed_rows(segment_ids, attention_mask, positions, cache)
    if cache is not None:
        if positions is None or cache_index is None:
            raise ConfigError("decoding with a cache needs positions [B, T] and cache_index (the "
                              "slot of the first new token); pass both.")
        if attention_mask is None:
            slots = next(iter(cache["layers"].values()))["k"].shape[1]
            attention_mask = jnp.ones((b, slots), jnp.int32)
        return positions, attention_mask, cache_index + jnp.arange(t)
    if attention_mask is None:
        attention_mask = jnp.ones((b, t), jnp.int32)
    if positions is None:
        positions = jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
    return positions, attention_mask, jnp.arange(t)


def cached_attention(q, k, v, key_valid, query_slots, cache=None, cache_index=None, scale=None,
                     segment_ids=None):
    """Causal attention of ``q`` over ``k``/``v`` [B, T, heads, head_dim]; with ``cache``
    ({"k", "v"} [B, S, heads, head_dim]) this call's keys and values are written at slots
    ``cache_index ...`` first and all slots are attended; with ``segment_ids`` [B, T] (packed
    rows, no cache) within each segment only. -> ``(out [B, T, heads, head_dim], new cache or
    None)``."""
    if cache is not None:
        cache = {"k": write_cache(cache["k"], k, cache_index),
                 "v": write_cache(cache["v"], v, cache_index)}
        k, v = cache["k"], cache["v"]
    mask = attention_mask(query_slots, jnp.arange(k.shape[1]), key_valid,
                          segment_ids=segment_ids)
    return attend(q, k, v, mask, scale=scale), cache


def key_mask(mask, batch, length):
    """Boolean [B, 1, 1, S]: every query may attend to the real keys (``mask`` [B, S] 1/0; all
    real when None)."""
    if mask is None:
        return jnp.ones((batch, 1, 1, length), bool)
    return mask.astype(bool)[:, None, None, :]


def empty_kv_cache(n_layers, batch, max_length, heads, head_dim, dtype):
    """``{"layers": {"0": {"k": zeros [B, S, heads, head_dim], "v": ...}, ...}}``."""
    shape = (batch, max_length, heads, head_dim)
    return {"layers": {str(i): {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                       for i in range(n_layers)}}


def split_heads(x, heads):
    """[B, T, heads * d] -> [B, T, heads, d]."""
    return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)


def merge_heads(x):
    """[B, T, heads, d] -> [B, T, heads * d]."""
    return x.reshape(*x.shape[:-2], -1)


def run_layer(layer, remat, *args):
    """``layer(*args)``; with ``remat`` only the inputs are kept for the backward pass."""
    if remat:
        return nnx.remat(lambda lyr, *a: lyr(*a))(layer, *args)
    return layer(*args)
