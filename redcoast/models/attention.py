"""Which kernel computes one attention call: cuDNN's fused (flash) attention, XLA's, or XLA's a
block of queries at a time.

``jax.nn.dot_product_attention`` with no ``implementation`` runs XLA's unfused attention on every
platform, GPUs included. redcoast chooses per call, at trace time, from what the call looks like:
cuDNN where the device, dtype, head size and mask allow it, XLA otherwise.
:func:`choose_implementation` is that decision, as a pure function of the call's facts, so it
can be tested anywhere; :func:`dot_product_attention` applies it. "XLA" is redcoast's own
:func:`xla_attention` (standard operations, normalised after the product with the values),
which steps faster than jax's XLA path and keeps less for the backward pass.

XLA's attention holds a layer's scores, ``[B, N, T, S]``, for the backward pass: 2 GiB a layer
at 4096 tokens and 32 heads in float32, O(T * S). cuDNN's flash kernel holds O(T) (the
log-sum-exp of each row) and recomputes the scores in its backward pass. ``"blocked"``
(:func:`blocked_attention`) computes XLA's attention a block of queries at a time, each block
recomputed in the backward pass: the same numbers as ``"xla"`` with O(block * S) memory, what
``redcoast plan`` needs to see on a compiler that has no flash kernel (XLA:CPU standing in for
a GPU). Chosen only when asked: ``attention_implementation="blocked"``.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from ..errors import ConfigError
from ..sharding.axes import MODEL_AXIS
from ..sharding.context import layout_mesh, vendor_kernels

IMPLEMENTATIONS = (None, "xla", "cudnn", "blocked")  # None: chosen per call
QUERY_BLOCK = 512  # queries a block of blocked_attention computes at once


@dataclasses.dataclass(frozen=True)
class Choice:
    """The kernel chosen for one call, and why (readable in logs and tests)."""

    implementation: str  # "xla" or "cudnn"
    reason: str


def cuda_capability(device=None):
    """``(major, minor)`` compute capability of a CUDA device (by default the first device of
    the default backend), or None for any other device."""
    device = device or jax.devices()[0]
    value = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    if not value:
        return None
    major, minor = str(value).split(".")[:2]
    return int(major), int(minor)


def choose_implementation(q_shape, kv_shape, dtype, *, has_mask, capability, requested=None):
    """The kernel for attention of ``q [B, T, N, H]`` over ``k/v [B, S, K, H]`` in ``dtype``.

    ``has_mask``: an explicit mask or bias is applied (cuDNN adds it as a bias); a causal or
    windowed call without one is handled by cuDNN natively. ``capability``: the device's CUDA
    compute capability (:func:`cuda_capability`), None for CPU, TPU and other GPUs.
    ``requested``: None to choose, or "xla" / "cudnn" to force one.
    """
    if requested not in IMPLEMENTATIONS:
        raise ConfigError(f"attention_implementation={requested!r}; use one of {IMPLEMENTATIONS} "
                          "(None chooses per call).")
    if requested in ("xla", "blocked"):
        return Choice(requested, f"forced by attention_implementation={requested!r}")
    if requested == "cudnn":
        if capability is None:
            raise ConfigError("attention_implementation='cudnn' needs an NVIDIA GPU; this device "
                              "has none. Fix: leave attention_implementation=None (redcoast "
                              "chooses per call) or use 'xla'.")
        return Choice("cudnn", "forced by attention_implementation='cudnn'")
    t, head_dim = q_shape[1], q_shape[-1]
    s = kv_shape[1]
    if capability is None:
        return Choice("xla", "not an NVIDIA GPU (cuDNN attention runs on CUDA devices only)")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return Choice("xla", f"{jnp.dtype(dtype).name} inputs (cuDNN's fused attention takes "
                             "bfloat16 or float16)")
    max_head_dim = 256 if capability >= (9, 0) else 128
    if head_dim % 8 or head_dim > max_head_dim or kv_shape[-1] != head_dim:
        return Choice("xla", f"head size {head_dim} (cuDNN needs a multiple of 8 up to "
                             f"{max_head_dim}, the same for keys and values)")
    if t == 1:
        return Choice("xla", "one query per row (a decoding step: nothing to fuse)")
    if has_mask and (t % 2 or s % 2):
        return Choice("xla", f"a mask with odd lengths {t}x{s} (cuDNN's masked kernel needs even "
                             "ones)")
    return Choice("cudnn", f"{jnp.dtype(dtype).name}, head size {head_dim}, "
                           f"{'masked' if has_mask else 'causal or unmasked'}")


def dot_product_attention(q, k, v, *, mask=None, causal=False, window=None, scale=None,
                          implementation=None):
    """Attention of ``q [B, T, N, H]`` over ``k, v [B, S, K, H]`` (``N`` a multiple of ``K``)
    through the kernel :func:`choose_implementation` picks.

    ``mask``: boolean, broadcastable to ``[B, N, T, S]``, True where a query may attend.
    ``causal``: query ``t`` sees keys ``<= t`` (T == S, aligned); ``window``: and only the
    ``window`` latest of them. Both are handled inside the kernel, with no mask in memory.
    """
    if vendor_kernels():
        choice = choose_implementation(q.shape, k.shape, q.dtype, has_mask=mask is not None,
                                       capability=cuda_capability(), requested=implementation)
    else:  # traced for the data-flow analysis, which follows standard operations only
        choice = Choice("xla", "traced for redcoast's data-flow analysis")
    if choice.implementation == "blocked":
        return blocked_attention(q, k, v, mask=mask, causal=causal, window=window, scale=scale)
    if choice.implementation == "xla":
        return xla_attention(q, k, v, mask=mask, causal=causal, window=window, scale=scale)
    local = None if window is None else (window - 1, 0)
    mesh = layout_mesh()
    if mesh is not None and mesh.shape.get(MODEL_AXIS, 1) > 1:
        q, k, v = split_alike(q, k, v, mesh)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=causal,
                                        local_window_size=local, implementation="cudnn")


def split_alike(q, k, v, mesh):
    """``q, k, v`` (``[B, T, N, H]``) constrained to one sharding on ``mesh``: cuDNN's
    partitioner takes them only split alike ("Query, key and value should have same sharding":
    the compile fails), which XLA's propagation does not ensure (K/V repeated per query head: a
    Mistral's 4 K/V heads on 8 model shards). The heads split over the model shards where both
    counts divide, else whole; positions and head size whole (cuDNN refuses them split); the
    batch as the rest of the step splits it."""
    n = mesh.shape[MODEL_AXIS]
    heads = MODEL_AXIS if q.shape[2] % n == 0 and k.shape[2] % n == 0 else None
    sharding = NamedSharding(mesh, P(P.UNCONSTRAINED, None, heads, None))
    return [jax.lax.with_sharding_constraint(x, sharding) for x in (q, k, v)]


def _allowed(mask, causal, window, t, s, kv_heads, offset=0):
    """Where a query may attend, broadcastable to ``[B, K, G, T, S]``, or None for everywhere;
    the queries are at positions ``offset .. offset + t - 1`` of the keys'."""
    allowed = None
    if mask is not None:
        mask = jnp.asarray(mask, bool)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # [B, N, T, S]
        heads = mask.shape[1]
        allowed = (mask[:, :, None] if heads == 1 else  # one mask for every head
                   mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, *mask.shape[2:]))
    if causal or window is not None:  # a window is of past keys, causal or not (as jax's)
        query, key = offset + jnp.arange(t)[:, None], jnp.arange(s)[None, :]
        by_position = key <= query
        if window is not None:
            by_position = by_position & (query - key < window)
        allowed = by_position if allowed is None else allowed & by_position
    return allowed


def xla_attention(q, k, v, *, mask=None, causal=False, window=None, scale=None, offset=0):
    """Attention in standard operations, for compilers without a fused kernel (XLA:CPU, TPUs,
    GPUs where cuDNN is not chosen); arguments as :func:`dot_product_attention`'s, and
    ``offset``: the position of the first query among the keys (a block of queries; traced or
    not), for ``causal`` and ``window``.

    ``jax.nn.dot_product_attention``'s XLA path normalises the probabilities before multiplying
    them with the values and keeps the scores in float32 into the backward pass's products. This
    one does what MaxText's and transformers' eager attention do: each query group shares its
    K/V head (no repeat), the scores come out of the product in the inputs' dtype and are
    softmaxed in float32, and the row sums divide the product with the values afterwards, so no
    normalised ``[B, N, T, S]`` tensor is written or kept. In float32 the numbers equal jax's to
    rounding; in bfloat16 the scores are rounded to bfloat16 as transformers' eager attention
    rounds them. Measured (benchmarks/B2.md: SmolLM2-135M's shape at 12 layers, 512 tokens, 8
    simulated CPU devices, jax 0.12): the training step 11% shorter than with jax's attention
    (9.89 against 11.08 s), its compiled peak 11% lower (792 against 895 MiB).
    """
    b, t, n, head_dim = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    grouped = q.reshape(b, t, kv_heads, n // kv_heads, head_dim)
    scores = jnp.einsum("btkgh,bskh->bkgts", grouped, k).astype(jnp.float32) * scale
    allowed = _allowed(mask, causal, window, t, s, kv_heads, offset)
    if allowed is not None:  # jax's value: a row that may attend nowhere averages every value
        scores = jnp.where(allowed, scores, -0.7 * jnp.finfo(jnp.float32).max)
    top = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    weights = jnp.exp(scores - top)
    totals = jnp.moveaxis(weights.sum(axis=-1), -1, 1)[..., None]  # [B, T, K, G, 1]
    out = jnp.einsum("bkgts,bskh->btkgh", weights.astype(v.dtype), v)
    return (out.astype(jnp.float32) / totals).astype(q.dtype).reshape(b, t, n, head_dim)


def blocked_attention(q, k, v, *, mask=None, causal=False, window=None, scale=None,
                      block=QUERY_BLOCK):
    """XLA's attention (as :func:`dot_product_attention` takes it) computed ``block`` queries at
    a time under a scan whose body is rematerialised: the backward pass holds one block's scores,
    ``[B, N, block, S]``, not all of them. Each block is :func:`xla_attention` over
    every key with that block's rows of the mask and the block's first position as its offset,
    so each row's softmax is the one XLA's attention computes."""
    b, t, n, _ = q.shape
    block = min(block, t)
    n_blocks = -(-t // block)
    pad = n_blocks * block - t  # padded queries attend as the mask allows, then are dropped
    if mask is not None:
        mask = jnp.asarray(mask, bool)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    rows_masked = mask is not None and mask.shape[2] != 1

    def blocks(x, axis):  # [..., n_blocks * block, ...] -> [n_blocks, ..., block, ...]
        x = jnp.pad(x, [(0, pad if d == axis else 0) for d in range(x.ndim)],
                    constant_values=True if x.dtype == bool else 0)
        x = x.reshape(x.shape[:axis] + (n_blocks, block) + x.shape[axis + 1:])
        return jnp.moveaxis(x, axis, 0)

    def one(_, xs):
        q_block, mask_block, first = xs
        block_mask = mask if mask is not None and not rows_masked else mask_block
        out = xla_attention(q_block, k, v, mask=block_mask, causal=causal, window=window,
                            scale=scale, offset=first)
        return None, out

    # no CSE barrier needed inside a scan body (the loop keeps the recomputation apart)
    step = jax.checkpoint(one, prevent_cse=False)
    xs = (blocks(q, 1), blocks(mask, 2) if rows_masked else None,
          jnp.arange(n_blocks) * block)
    _, out = jax.lax.scan(step, None, xs)
    out = jnp.moveaxis(out, 0, 1).reshape(b, n_blocks * block, n, q.shape[-1])
    return out[:, :t]
