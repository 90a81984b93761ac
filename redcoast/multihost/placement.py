"""Placing a pytree on shardings the same way on every process.

``jax.device_put`` moves each array that spans processes with its own small program, whose
collectives cross the processes, and dispatches them all before any finishes. JAX's CPU
runtime may run such independent programs in any order: two processes that run them in
different orders wait on each other's collectives for ever. Measured (2 processes x 4 CPU
devices, gloo, 40 arrays moved back and forth between two device orders, 30 rounds):
``jax.device_put`` of the tree hung in 7 of 8 runs on jax 0.10.2 and 4 of 4 on 0.11.2 (after
rounds 1 to 21), none of 6 on 0.12.0.1; one array at a time, each move finished before the next
is dispatched, ran the 30 rounds in 2.9 s every time (tests/test_multiprocess.py).
"""

import jax
from jax.sharding import Sharding


def device_put(tree, shardings, donate: bool = False):
    """``jax.device_put(tree, shardings, donate=donate)`` (``shardings``: one sharding, or a
    tree of them that is a prefix of ``tree``); with several processes, the arrays that span
    processes are moved one at a time, in the tree's order, each finished before the next."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings, donate=donate)
    return jax.tree_util.tree_map(
        lambda sharding, subtree: _put_in_order(subtree, sharding, donate),
        shardings, tree, is_leaf=_is_target)


def _is_target(x) -> bool:
    return x is None or isinstance(x, (Sharding, jax.Device))


def _put_in_order(subtree, sharding, donate: bool):
    def put(x):
        moved = jax.device_put(x, sharding, donate=donate)
        # its collectives done before the next move starts; an array already placed so is
        # returned as it is (no program ran: nothing to wait for, e.g. a Predictor's params)
        if moved is not x and isinstance(x, jax.Array) and not x.is_fully_addressable:
            moved.block_until_ready()
        return moved
    return jax.tree_util.tree_map(put, subtree)
