"""Moving results from devices to the host, the same on every process."""

import jax
import numpy as np
from jax.experimental import multihost_utils


def to_host(tree):
    """Numpy copies of ``tree``'s arrays, complete on every process (one sync)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def process_0s(value):
    """Process 0's ``value`` (a numpy array or scalar) on every process: a decision one process
    takes for all (one collective; none with a single process)."""
    if jax.process_count() == 1:
        return np.asarray(value)
    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(value)))
