"""Small building blocks shared by redcoast's reference models.

- :class:`RMSNorm`: root-mean-square normalisation, computed in float32 whatever the input dtype.
- Rotary position embeddings: :func:`rope_inv_freq` (the per-pair frequencies, with the scaling
  variants Hugging Face configs name: ``linear``, ``dynamic``, ``llama3``, ``yarn``),
  :func:`rotary_cos_sin` (cos/sin tables for given positions) and :func:`apply_rotary`
  (the "rotate half" convention of Hugging Face checkpoints, or GPT-J's interleaved pairs on
  part of each head).
- Attention with a key/value cache: :func:`attention_mask` (causal, padding, optional sliding
  window, optional segments of packed sequences, over query and key *slots*;
  :func:`segment_positions` for the packed sequences' positions), :func:`write_cache` (a traceable in-place write) and
  :func:`attend` (cuDNN's fused attention on NVIDIA GPUs where the call allows it, XLA's elsewhere).

Every function is independent of any one model family: they take plain numbers and arrays.
Array layouts: activations ``[batch, time, heads, head_dim]``, caches ``[batch, slots,
kv_heads, head_dim]``, masks ``[batch, 1, queries, keys]`` (True = may attend).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..errors import ConfigError
from ..sharding.context import model_shards
from .attention import dot_product_attention


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale`` over the last axis; the statistics are taken in float32 and the
    result is returned in ``dtype`` (the input's dtype when None)."""

    def __init__(self, dim, *, eps=1e-6, dtype=None, param_dtype=jnp.float32):
        self.eps = eps
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x):
        dtype = self.dtype or x.dtype
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        # Round to the input dtype before the scale, as the reference checkpoints were trained.
        return (self.scale.astype(dtype) * h.astype(x.dtype).astype(dtype)).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _base_inv_freq(dim, theta):
    # float32 throughout, as the reference implementations compute it
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)


def _llama3_inv_freq(inv_freq, scaling):
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = np.float32(2 * math.pi) / inv_freq
    # Long wavelengths (low frequencies) are divided by ``factor``; short ones kept; those in
    # between are interpolated linearly in 1/wavelength.
    scaled = np.where(wavelen > old_context / low, inv_freq / np.float32(factor), inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(dim, theta, scaling, max_position_embeddings):
    factor = scaling.get("factor")
    original = scaling["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (mscale(factor, m) / mscale(factor, m_all) if m and m_all
                            else mscale(factor))
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        # the pair index whose wavelength makes ``rotations`` turns over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (high frequencies kept as they are)
    pos_freqs = np.power(np.float32(theta), np.arange(0, dim, 2).astype(np.float32) / dim)
    extrapolated = np.float32(1.0) / pos_freqs
    interpolated = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_inv_freq(head_dim, theta, scaling=None, max_position_embeddings=None):
    """``(inv_freq [head_dim // 2] float32 numpy, attention_factor)`` for a rotary embedding.

    ``scaling`` is a Hugging Face ``rope_parameters``-style mapping with ``rope_type`` (or
    ``type``) among :data:`ROPE_TYPES` and that type's fields (``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``, ``beta_fast``, ...); None means
    plain RoPE. ``dynamic`` depends on the sequence length: this gives its frequencies for
    sequences within ``max_position_embeddings`` (use :func:`rotary_cos_sin` for the rest).
    ``attention_factor`` multiplies cos and sin (YaRN's attention temperature; 1 otherwise).
    """
    kind = rope_type(scaling)
    inv_freq = _base_inv_freq(head_dim, theta)
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    return _yarn_inv_freq(head_dim, theta, scaling, max_position_embeddings)


def rope_type(scaling):
    """The scaling's type name, or a clear error for one redcoast does not implement."""
    kind = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope scaling type {kind!r} is not supported; redcoast implements "
                          f"{list(ROPE_TYPES)}. Fix: use a checkpoint with one of those, or add the "
                          "type to redcoast/models/layers.py.")
    return kind


def rotary_cos_sin(positions, head_dim, theta, scaling=None, max_position_embeddings=None):
    """cos, sin tables ``[*positions.shape, head_dim]`` (float32) for integer ``positions``.

    With ``dynamic`` (NTK) scaling the base grows with the longest sequence in the call,
    ``max(positions) + 1``, once that exceeds ``max_position_embeddings`` (as Hugging Face does
    for one forward pass; its cached decoding keeps the largest base seen so far instead).
    """
    inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings)
    inv_freq = jnp.asarray(inv_freq)
    if rope_type(scaling) == "dynamic":
        factor = scaling["factor"]
        seq_len = jnp.maximum(jnp.max(positions) + 1, max_position_embeddings).astype(jnp.float32)
        grown = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (
            head_dim / (head_dim - 2))
        exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
        inv_freq = jnp.where(seq_len > max_position_embeddings, 1.0 / (grown ** exponents), inv_freq)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rotary(x, cos, sin, interleaved=False):
    """Rotate ``x [B, T, H, D]`` by the angles in ``cos``/``sin [B, T, R]`` (from
    :func:`rotary_cos_sin` with ``head_dim=R``).

    By default the first and second halves of the rotated dimensions form the pairs (the Llama
    layout of Hugging Face checkpoints); ``interleaved=True`` pairs neighbours (0, 1), (2, 3), ...
    (GPT-J, GPT-NeoX-style "rotate every two"). With ``R < D`` only the first ``R`` dimensions of
    each head are rotated and the rest pass unchanged (GPT-J's ``rotary_dim``)."""
    partial = cos.shape[-1] < x.shape[-1]
    # whole heads are not sliced at all: the same traced ops as before partial rotation existed
    rot, rest = (x[..., :cos.shape[-1]], x[..., cos.shape[-1]:]) if partial else (x, None)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    half = rot.shape[-1] // 2
    if interleaved:
        # the tables repeat each pair's angle over two halves; pairs are neighbours here
        cos = jnp.repeat(cos[..., :half], 2, axis=-1)
        sin = jnp.repeat(sin[..., :half], 2, axis=-1)
        pairs = rot.reshape(*rot.shape[:-1], half, 2)
        # (a, b) -> (-b, a); concatenated, not stacked, so the sharding planner follows it
        rotated = jnp.concatenate([-pairs[..., 1:], pairs[..., :1]], axis=-1).reshape(rot.shape)
    else:
        rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = rot * cos + rotated * sin
    return jnp.concatenate([out, rest], axis=-1) if partial else out


# ---------------------------------------------------------------------------------------------
# Attention with a cache

def attention_mask(query_slots, key_slots, key_valid, sliding_window=None, segment_ids=None):
    """Boolean ``[B, 1, T, S]``: query at slot ``query_slots[t]`` may attend to key slot
    ``key_slots[s]`` when it is not later, holds a real token (``key_valid [B, S]``) and, with
    ``sliding_window``, lies fewer than that many slots back; with ``segment_ids [B, T]``
    (several sequences packed in one row, no cache: T == S), only within its own segment.

    A query that would see nothing (a padding position) attends to its own slot instead, so no
    softmax row is empty: its output is meaningless but finite, and gradients stay finite.
    """
    q = query_slots[:, None]
    k = key_slots[None, :]
    allowed = k <= q
    if sliding_window is not None:
        allowed = allowed & (q - k < sliding_window)
    allowed = allowed[None] & key_valid.astype(bool)[:, None, :]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return (allowed | (k == q)[None])[:, None]


def segment_positions(segment_ids):
    """``[B, T]`` positions counted from the first token of each token's segment (0 there):
    the positions of sequences packed in one row, each as if it stood alone."""
    t = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(t), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=-1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def write_cache(cache, new, index):
    """``cache [B, S, ...]`` with ``new [B, T, ...]`` written at slots ``index .. index+T-1``
    (``index`` may be traced; shapes stay fixed)."""
    start = (0, index) + (0,) * (cache.ndim - 2)
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), start)


def attend(q, k, v, mask, scale=None, *, causal=False, window=None, implementation=None):
    """Scaled dot-product attention ``[B, T, H, D]`` through the kernel
    :mod:`redcoast.models.attention` chooses (cuDNN's fused attention on NVIDIA GPUs where the
    call allows it, XLA's otherwise; ``implementation`` forces "xla" or "cudnn").

    ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention: each group of
    ``H // KVH`` query heads shares one key/value head); ``mask`` as from :func:`attention_mask`,
    or None with ``causal`` (and ``window``) for unpadded causal attention without a cache,
    which the kernel masks itself. Traced for more model shards than KV heads
    (``redcoast.sharding.context``), K/V are repeated per query head so that attention splits
    over the query heads.
    """
    k = k.astype(q.dtype)
    v = v.astype(q.dtype)
    heads, kv_heads, n = q.shape[2], k.shape[2], model_shards()
    if kv_heads < heads and kv_heads % n and heads % n == 0:
        # More model shards than KV heads: so that the query heads can be split, K/V are
        # repeated to one per query head (the plan keeps each KV head on the shards of its
        # query heads, or replicates the K/V projections; sharding/grouped_axes.py).
        k, v = (jnp.repeat(x, heads // kv_heads, axis=2) for x in (k, v))
    return dot_product_attention(q, k, v, mask=mask, causal=causal, window=window, scale=scale,
                                 implementation=implementation)
