"""A split over consecutive groups of one mesh axis: ``'mp:2'`` in a PartitionSpec.

With more model shards than KV heads, the query heads are split over the shards and every K/V
head is needed by the shards that hold its query heads, a consecutive group of them. Keeping that
head only on its group (split over the groups, replicated within one) instead of on every shard
means the K/V weight gradient is summed within the group, not over all shards and then gathered;
it also stores 1/groups of K/V per device.

``'mp:k'`` names the major factor of size ``k`` of the 'mp' axis: shard ``s`` holds block
``s // (n / k)`` of the dimension. A ``NamedSharding`` cannot say this on the (dp, mp) mesh, so
:func:`named_sharding` builds it on the same devices viewed as (dp, 'mp:k', 'mp:k/within'): the
same device order, so XLA compiles it with the rest of the step.
"""

import functools

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

SEPARATOR = ":"


def grouped(axis, groups):
    """The spec entry splitting a dimension over ``groups`` consecutive groups of ``axis``."""
    return f"{axis}{SEPARATOR}{int(groups)}"


def parse(entry):
    """``(axis, groups)`` for a grouped entry like ``'mp:2'``, else ``(entry, None)``."""
    if isinstance(entry, str) and SEPARATOR in entry:
        axis, _, groups = entry.partition(SEPARATOR)
        if groups.isdigit() and int(groups) > 0:
            return axis, int(groups)
    return entry, None


def axis_size(entry, axis_sizes):
    """The number of pieces one spec entry name splits a dimension into, or None if the mesh
    has no such axis (or the groups do not divide it)."""
    axis, groups = parse(entry)
    if axis not in axis_sizes:
        return None
    if groups is None:
        return axis_sizes[axis]
    return groups if axis_sizes[axis] % groups == 0 else None


def entries(spec):
    """The mesh axis names a PartitionSpec names, one per name (grouped ones as written)."""
    for entry in spec:
        for name in (entry if isinstance(entry, tuple) else (entry,)):
            if name is not None:
                yield name


@functools.lru_cache(maxsize=None)
def factored_mesh(mesh, axis, groups):
    """``mesh`` with ``axis`` split into (``groups``, the rest): same devices, same order."""
    names = list(mesh.axis_names)
    i = names.index(axis)
    shape = list(mesh.devices.shape)
    devices = mesh.devices.reshape(shape[:i] + [groups, shape[i] // groups] + shape[i + 1:])
    new_names = names[:i] + [grouped(axis, groups), grouped(axis, groups) + "/within"] + names[i + 1:]
    types = getattr(mesh, "axis_types", None)
    if types is None:
        return Mesh(devices, tuple(new_names))
    types = tuple(types)
    return Mesh(devices, tuple(new_names), axis_types=types[:i] + (types[i],) * 2 + types[i + 1:])


def named_sharding(mesh, spec):
    """``NamedSharding(mesh, spec)``, where ``spec`` may name grouped axes."""
    found = {parse(name) for name in entries(spec) if parse(name)[1] is not None}
    if not found:
        return NamedSharding(mesh, spec)
    if len(found) > 1:
        raise ValueError(f"{spec}: one grouped axis per PartitionSpec is supported")
    (axis, groups), = found
    if mesh.shape[axis] % groups:
        raise ValueError(f"{spec}: {groups} groups do not divide mesh axis {axis!r} of size "
                         f"{mesh.shape[axis]}")
    factored = factored_mesh(mesh, axis, groups)
    whole = (grouped(axis, groups), grouped(axis, groups) + "/within")

    def translate(entry):
        if entry is None:
            return None
        names = entry if isinstance(entry, tuple) else (entry,)
        out = []
        for name in names:
            out.extend(whole if name == axis else (name,))
        return out[0] if len(out) == 1 else tuple(out)

    return NamedSharding(factored, P(*[translate(e) for e in spec]))


def per_device_pieces(spec, axis_sizes):
    """How many pieces ``spec`` cuts a tensor into on a mesh of ``axis_sizes``."""
    return int(np.prod([axis_size(name, axis_sizes) or 1 for name in entries(spec)]))
