"""Operations JAX lowers with the devices in hand: a custom partitioning rule (cuDNN's fused
attention on a GPU, a user's ``custom_partitioning``) or a host callback (``pure_callback``,
``io_callback``).

A program holding one is held to more than XLA's own partitioner asks: JAX lowers it only if
every sharding in it is on one mesh ("mesh should be the same across the entire program"), and
cuDNN's rule refuses operands split by positions ("Sharding on sequence dim is not allowed").
The layout does not make the choices that would break either (K/V heads kept by groups of
shards, on a second view of the mesh; matmuls split by positions) in a step that holds one.
"""

import jax
from jax._src import dispatch  # jax.extend does not say which primitives need the devices

from .interpreter import sub_programs, total


def _registry():
    """JAX's set of the primitives it lowers with the devices in hand."""
    found = getattr(dispatch, "prim_requires_devices_during_lowering", None)
    if not isinstance(found, (set, frozenset)):
        raise NotImplementedError(
            f"this JAX ({jax.__version__}) no longer keeps the primitives it lowers with the "
            "devices in hand where redcoast reads them (jax._src.dispatch."
            "prim_requires_devices_during_lowering); redcoast needs an update for it "
            "(sharding/device_bound.py).")
    return found


def _count(eqn, total_of):
    if eqn.primitive in _registry():
        return 1
    return sum(total_of(sub) for _, _, sub in sub_programs(eqn))


def device_bound(eqn):
    """Whether ``eqn`` is, or holds, an operation JAX lowers with the devices in hand."""
    return _count(eqn, lambda sub: total(sub, _count)) > 0


def holds_device_bound(program):
    """Whether ``program`` (a Jaxpr or ClosedJaxpr) holds an operation JAX lowers with the
    devices in hand."""
    return total(program, _count) > 0
