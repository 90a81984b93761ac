"""Optimizer-state placement matched to parameters by path and shape, not by tree structure.

An optimizer state leaf whose path ends with a parameter's path takes that parameter's spec when
the shapes agree (adam's mu and nu, momentum, lion), or the spec with one axis dropped when its
shape is the parameter's with one axis reduced (adafactor's factored row and column statistics).
Everything else (step counts, scalars, placeholders) is replicated.
"""

import jax
from jax.sharding import PartitionSpec as P

from .paths import path_to_tuple
from .rules import normalize_spec


def _spec_of_rank(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


def state_leaf_spec(leaf_path, leaf_shape, param_specs_by_path):
    """The spec for one optimizer-state leaf, or ``P()``."""
    for start in range(len(leaf_path)):
        found = param_specs_by_path.get(leaf_path[start:])
        if found is None:
            continue
        param_shape, spec = found
        full = _spec_of_rank(spec, len(param_shape))
        if tuple(leaf_shape) == tuple(param_shape):
            return spec
        if len(leaf_shape) == len(param_shape) - 1:
            candidates = {tuple(full[:axis] + full[axis + 1:]) for axis in range(len(param_shape))
                          if tuple(param_shape[:axis] + param_shape[axis + 1:]) == tuple(leaf_shape)}
            if len(candidates) == 1:  # unambiguous which axis was reduced
                return P(*candidates.pop())
        if len(leaf_shape) == len(param_shape):  # reduced axes kept with size 1
            kept = tuple(a if d == pd else None for a, d, pd in zip(full, leaf_shape, param_shape))
            if any(d not in (1, pd) for d, pd in zip(leaf_shape, param_shape)):
                return P()
            return P(*kept)
        return P()
    return P()


def opt_state_specs(opt_state, placements):
    """A pytree of PartitionSpecs shaped like ``opt_state``, from the parameters' placements."""
    by_path = {pl.path: (tuple(pl.shape), pl.spec) for pl in placements}
    return jax.tree_util.tree_map_with_path(
        lambda kp, leaf: normalize_spec(
            state_leaf_spec(path_to_tuple(kp), tuple(getattr(leaf, "shape", ())), by_path)),
        opt_state)
