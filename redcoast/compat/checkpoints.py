"""redco's checkpoint directories: ``ckpt_dir/params``, ``ckpt_dir/opt_state`` (Orbax) and
``ckpt_dir/info.json``, written and read without pickle.

redco also pickled the parameter shapes (``params_shape.pkl``); redcoast reads them from Orbax's
own metadata instead, so it restores directories written by redco and by this module alike. These
are for scripts that save or load weights by hand; the Trainer's own checkpoints
(``workdir/checkpoints``, resumed by ``fit``) are redcoast's.
"""

import json
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from ..errors import ConfigError


def plain_dicts(tree):
    """FrozenDicts and other mappings as plain dicts (what Orbax stores and restores)."""
    if isinstance(tree, Mapping):
        return {k: plain_dicts(v) for k, v in tree.items()}
    return tree


def _cast(tree, float_dtype):
    if float_dtype is None:
        return tree
    return jax.tree_util.tree_map(
        lambda x: x.astype(float_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def save_redco_ckpt(ckpt_dir, params, opt_state=None, float_dtype=None, info=None):
    """Write ``params`` (and ``opt_state``) under ``ckpt_dir`` as redco laid them out."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    checkpointer = ocp.PyTreeCheckpointer()
    for name, tree in (("params", params), ("opt_state", opt_state)):
        if tree is not None:
            checkpointer.save(os.path.join(ckpt_dir, name), _cast(plain_dicts(tree), float_dtype),
                              force=True)
    if jax.process_index() == 0:
        with open(os.path.join(ckpt_dir, "info.json"), "w") as f:
            json.dump(info or {}, f, indent=4)


def saved_shapes(directory):
    """The tree of ``jax.ShapeDtypeStruct`` of an Orbax PyTree checkpoint, from its metadata."""
    if not os.path.isdir(directory):
        raise ConfigError(f"No checkpoint at {directory}. Fix: check the path (redco's layout is "
                          "ckpt_dir/params, ckpt_dir/opt_state, ckpt_dir/info.json).")
    metadata = ocp.PyTreeCheckpointer().metadata(directory)
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    return jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree,
                                  is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))


def restore_tree(directory, abstract, shardings, float_dtype=None):
    """Restore the PyTree checkpoint at ``directory`` onto ``shardings`` (each device reads its slices)."""
    def restore_args(a, sharding):
        dtype = float_dtype if float_dtype is not None and jnp.issubdtype(a.dtype, jnp.floating) else None
        return ocp.ArrayRestoreArgs(sharding=sharding, dtype=dtype)

    args = jax.tree_util.tree_map(restore_args, abstract, shardings)
    return ocp.PyTreeCheckpointer().restore(
        directory, args=ocp.args.PyTreeRestore(item=abstract, restore_args=args))


def read_info(ckpt_dir):
    path = os.path.join(ckpt_dir, "info.json")
    info = {}
    if os.path.exists(path):
        with open(path) as f:
            info = json.load(f)
    if "rng" in info:
        info["rng"] = jnp.asarray(np.asarray(info["rng"], dtype=np.uint32))
    return info
