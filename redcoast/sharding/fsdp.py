"""FSDP (ZeRO-3): parameters, and with them optimizer state, also split over the 'dp' axis.

Applied after the tensor-parallel plan (automatic and user rules) is final: every large tensor
gets 'dp' on one more dimension, the largest one not already split that the data-parallel size
divides, so a device keeps about 1/device_count of it instead of 1/n_model_shards. A tensor the
tensor-parallel plan replicates (a fused QKV it could not split) or splits over groups of the
model shards (K/V with fewer heads than shards) is split over both axes, ('dp', 'mp'), when a
dimension divides by the device count: otherwise every model shard (group) would keep a 1/dp copy
of it. XLA all-gathers a parameter where the step uses it and reduce-scatters its gradient; the
batch stays split over 'dp' as before. Which tensors are worth splitting (each split costs the
step a collective) is decided by their cost, in fsdp_cost.py: the ones it ``keep``s stay
replicated over 'dp'.
"""

import dataclasses

from .annotations import REASON as ANNOTATION
from .axes import DATA_AXIS, MODEL_AXIS
from .grouped_axes import parse as parse_grouped
from .rules import _as_tuple

KEPT = "; replicated over dp (by cost: see the FSDP line under the table)"


def ungrouped_storage(placements, n_model_shards):
    """The placements with each split over groups of the model shards (``'mp:g'``, K/V heads
    kept by the shards of their query heads) stored split over every model shard instead, when
    the dimension divides: a device keeps 1/n_model_shards of the tensor, not 1/g, and the step
    gathers it to the groups where it is used (``ShardingPlan.compute_shardings``)."""
    out = []
    for pl in placements:
        spec = tuple(pl.spec)
        grouped = [d for d, axes in enumerate(spec)
                   if isinstance(axes, str) and parse_grouped(axes)[1] and parse_grouped(axes)[0] == MODEL_AXIS]
        if pl.reason != "user rule" and not pl.reason.startswith(ANNOTATION) and n_model_shards > 1 and len(grouped) == 1 and pl.shape[grouped[0]] % n_model_shards == 0:
            d = grouped[0]
            why = f"; stored split over all {n_model_shards} model shards, gathered to {spec[d]} where used"
            pl = dataclasses.replace(pl, spec=spec[:d] + (MODEL_AXIS,) + spec[d + 1:], reason=pl.reason + why)
        out.append(pl)
    return out


def fsdp_placements(placements, n_data_shards, n_model_shards=1, keep=frozenset()):
    """The placements with 'dp' added to one dimension of every tensor whose path is not in
    ``keep`` (('dp', 'mp') for tensors replicated over ``n_model_shards`` > 1 when a dimension
    divides).

    A spec that already names 'dp' (a user rule) is kept as written; with one data shard
    nothing changes.
    """
    if n_data_shards <= 1:
        return list(placements)
    return [dataclasses.replace(pl, reason=pl.reason + KEPT) if pl.path in keep
            else added_dp(pl, n_data_shards, n_model_shards) for pl in placements]


def gather_group(pl, n_data_shards, n_model_shards=1):
    """The devices FSDP would split ``pl`` over beyond its tensor-parallel placement (the data
    shards, or all devices for a tensor split over both axes), or None if FSDP leaves it."""
    if n_data_shards <= 1:
        return None
    out = added_dp(pl, n_data_shards, n_model_shards)
    if out.spec == pl.spec:
        return None
    both = any(_as_tuple(axes) == (DATA_AXIS, MODEL_AXIS) for axes in out.spec)
    return n_data_shards * (n_model_shards if both else 1)


def added_dp(pl, n, n_model):
    """``pl`` with 'dp' added to one dimension (see fsdp_placements), or as it is."""
    spec = list(pl.spec) + [None] * (len(pl.shape) - len(pl.spec))
    if any(DATA_AXIS in _as_tuple(axes) for axes in spec) or pl.reason.startswith(ANNOTATION):
        return pl  # as the user wrote it
    largest = lambda dims: max(dims, key=lambda d: (pl.shape[d], -d))  # noqa: E731 - first on a tie
    # a split over groups of the model shards (K/V heads, grouped_axes.py) keeps 1/groups of the
    # tensor per shard: over both axes it keeps 1/device_count, gathered by FSDP where used
    if n_model > 1 and all(axes is None or parse_grouped(axes)[1] for axes in spec):
        both = [d for d in range(len(spec)) if pl.shape[d] % (n * n_model) == 0]
        if both:
            dim = largest(both)
            spec = [None] * len(spec)
            spec[dim] = (DATA_AXIS, MODEL_AXIS)
            why = f"; dim {dim} split over all {n * n_model} devices (FSDP over dp and mp)"
            return dataclasses.replace(pl, spec=tuple(spec), reason=pl.reason + why)
    free = [d for d, axes in enumerate(spec) if axes is None and pl.shape[d] % n == 0]
    if not free:
        why = f"; replicated over dp (no unsplit dimension divisible by {n} data shards)"
        return dataclasses.replace(pl, reason=pl.reason + why)
    dim = largest(free)
    spec[dim] = DATA_AXIS
    why = f"; dim {dim} split over {n} data shards (FSDP)"
    return dataclasses.replace(pl, spec=tuple(spec), reason=pl.reason + why)
