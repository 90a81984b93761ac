"""A cheap fingerprint of a params tree, to tell in a checkpoint which base its adapters need.

Each leaf gives its path, shape, dtype and two 32-bit checksums of its bits: their plain sum and
a sum weighted by position (so a permutation of the values shows too), both modulo 2**32. Integer
sums wrap exactly whatever their order, so the fingerprint is the same on any mesh or number of
processes (float sums would differ by rounding). The reductions run on the devices, where the
leaves are, in one compiled program; only two numbers per leaf reach the host, in one transfer.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import CheckpointError
from ..multihost.host import to_host

VERSION = 1
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def _checksums(x):
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:  # 8-byte values become two uint32 words on a new last axis
        bits = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    position = jnp.zeros(bits.shape, jnp.uint32)
    for axis, size in enumerate(bits.shape):  # row-major index, wrapping: no reshape of x
        position = position * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
    weight = position * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)  # odd: every bit counts
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weight, dtype=jnp.uint32)])


_all_checksums = jax.jit(lambda leaves: [_checksums(x) for x in leaves])


def fingerprint(tree):
    """``{"version", "leaves": [[path, shape, dtype, checksum], ...]}`` of ``tree`` (None for
    None): JSON-ready, for a checkpoint's record."""
    if tree is None:
        return None
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    sums = to_host(_all_checksums([x for _, x in flat])) if flat else []
    return {"version": VERSION, "leaves": [
        [jax.tree_util.keystr(path), [int(d) for d in np.shape(x)], str(np.dtype(x.dtype)),
         f"{int(s[0]):08x}{int(s[1]):08x}"] for (path, x), s in zip(flat, sums)]}


def check_fingerprint(saved, tree, what="frozen_params", where="the checkpoint"):
    """Raise a :class:`CheckpointError` unless ``tree`` has the fingerprint ``saved`` (a
    record without one, written before fingerprints were kept, passes)."""
    if saved is None and tree is None:
        return
    if saved is None:
        return
    if tree is None:
        raise CheckpointError(
            f"{where} was trained with {what} (adapters on a frozen base), but this Trainer has "
            f"no {what}. Fix: pass the same base again, Trainer(..., {what}=base).")
    if not isinstance(saved, dict) or saved.get("version") != VERSION:
        return  # another format: nothing to compare with
    current = fingerprint(tree)
    old = {leaf[0]: leaf[1:] for leaf in saved["leaves"]}
    new = {leaf[0]: leaf[1:] for leaf in current["leaves"]}
    fix = (f"Fix: pass the {what} that run was trained on (the same base model and weights), "
           "or start this run in another workdir (or fit(..., resume=False)).")
    if old.keys() != new.keys():
        missing, extra = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
        raise CheckpointError(
            f"{where} was trained on other {what}: its base has {len(old)} arrays, this one "
            f"{len(new)}" + (f"; missing here: {missing[:4]}" if missing else "")
            + (f"; not in the checkpoint's: {extra[:4]}" if extra else "") + f". {fix}")
    shapes = [k for k in old if old[k][:2] != new[k][:2]]
    if shapes:
        k = shapes[0]
        raise CheckpointError(
            f"{where} was trained on other {what}: {len(shapes)} arrays differ in shape or dtype, "
            f"e.g. {k} was {old[k][0]} {old[k][1]}, is {new[k][0]} {new[k][1]}. {fix}")
    values = [k for k in old if old[k][2] != new[k][2]]
    if values:
        raise CheckpointError(
            f"{where} was trained on other {what}: same shapes, but the values of {len(values)} of "
            f"{len(old)} arrays differ (e.g. {', '.join(values[:3])}); adapters trained on one "
            f"base are wrong on another. {fix}")
