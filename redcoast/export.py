"""Exporting parameters as plain safetensors files (a flat dict of tensor name to array).

The files are readable with the ``safetensors`` package alone, without redcoast. Writes are
atomic: the file appears under its name only once complete. They stream one tensor at a time
(host memory near the largest tensor, not the model) and keep each tensor's dtype.
"""

import jax
import numpy as np
from jax.experimental import multihost_utils

from .errors import ConfigError
from .sharding.paths import leaves_with_paths, path_to_tuple
from .store.tensor_files import entry, write_safetensors

SEPARATOR = "."


def flat_tensors(params):
    """``{'params.Dense_0.kernel': np.ndarray, ...}`` gathered from every process's shards
    (the whole model in host memory: for tests and small models; files stream instead)."""
    out = {}
    for path, leaf in leaves_with_paths(params):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        out[SEPARATOR.join(path)] = np.ascontiguousarray(np.asarray(leaf))
    return out


def save_params(params, path):
    """Write ``params`` to ``path`` (safetensors) from process 0, atomically, one tensor at a
    time; every process must call it (split tensors are gathered one by one)."""
    write_safetensors(path, [entry(name, leaf) for name, leaf in named_tensors(params).items()])


def named_tensors(params):
    """``{tensor name: leaf}``, or a clear error when two leaves would get one name (a key
    with a dot in it: ``{"a.b": x, "a": {"b": y}}``), before anything is written."""
    out, where = {}, {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = SEPARATOR.join(path_to_tuple(key_path))
        if name in out:
            raise ConfigError(
                f"params{where[name]} and params{jax.tree_util.keystr(key_path)} would both be "
                f"stored as the tensor {name!r} (tensor names join the keys with "
                f"{SEPARATOR!r}), and a file with two tensors of one name cannot be read. Fix: "
                f"rename the key that holds {SEPARATOR!r}.")
        out[name], where[name] = leaf, jax.tree_util.keystr(key_path)
    return out


def load_params(path, like):
    """Read a safetensors file written by :func:`save_params` into the structure of ``like``."""
    from .store.safetensors_check import load_safetensors

    tensors = load_safetensors(path, "pass the file redcoast.export.save_params wrote, or "
                                     "write it again")
    expected = {SEPARATOR.join(p): np.shape(leaf) for p, leaf in leaves_with_paths(like)}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(k for k in set(expected) & set(tensors) if tuple(expected[k]) != tensors[k].shape)
    if missing or unexpected or wrong:
        lines = [f"missing: {k} {expected[k]}" for k in missing[:10]]
        lines += [f"unexpected: {k} {tensors[k].shape}" for k in unexpected[:10]]
        lines += [f"shape: {k} is {tensors[k].shape} in the file, {tuple(expected[k])} in the model"
                  for k in wrong[:10]]
        raise ConfigError(f"{path} holds parameters of another model:\n  " + "\n  ".join(lines) +
                         "\nFix: load it into the model it was saved from.")
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(
        treedef, [tensors[SEPARATOR.join(path_to_tuple(kp))] for kp, _ in flat])
