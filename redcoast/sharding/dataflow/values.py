"""What the analysis knows of a value: replicated, split over the model shards, or a parameter;
and the axis bookkeeping of reshapes, gathers and scatters that the rules share."""

import dataclasses


class DataflowError(Exception):
    """The function could not be traced or analysed; callers fall back to structural rules."""


@dataclasses.dataclass(frozen=True)
class Rep:
    """Replicated over model shards. ``vary``: axes along which it depends on the data (a
    residual-stream-like value varies along its width; a one-hot along the vocabulary does not).
    ``src``: (leaf, {axis: parameter axis}) when it is the output of a matmul with a replicated
    parameter that could follow a split instead (a LoRA B matrix)."""
    vary: frozenset = frozenset()
    src: tuple = None
    tainted: bool = False  # computed from the fallback of a conflict: decisions on it are tentative
    state: tuple = None    # (shape, steps, recurrent.CellCost or None) of the recurrent state
                           # (a loop carry) it comes from


@dataclasses.dataclass(frozen=True)
class Split:
    """Split over model shards along ``axis``; ``origins``: the parameters whose choice made it."""
    axis: int
    origins: frozenset
    state: tuple = None    # as Rep's: computed from a recurrent state


@dataclasses.dataclass(frozen=True)
class Par:
    """A parameter leaf seen through layout ops; ``axes[i]`` is the parameter axis of axis i."""
    leaf: int
    axes: tuple


CONST = Rep()


def all_axes(ndim):
    """Every axis of an ``ndim``-dimensional value."""
    return frozenset(range(ndim))


def shape_of(v):
    """The shape of a jaxpr variable or literal (() for a scalar token)."""
    return tuple(getattr(v.aval, "shape", ()))


def reshape_groups(a, b):
    """Pairs (in axes, out axes) of equal element count, in order; size-1 axes join a group."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj, pi, pj = [], [], 1, 1
        while True:
            if pi == pj and (gi or gj):
                # the group is complete: size-1 axes next on either side join it, not the next
                # one ((8, 1, 1, 32) -> (8, 1, 1, 4, 2, 4): the 1s go with the 8, not the 32)
                while i < len(a) and a[i] == 1:
                    gi.append(i)
                    i += 1
                while j < len(b) and b[j] == 1:
                    gj.append(j)
                    j += 1
                break
            if pi <= pj and i < len(a):
                pi *= a[i]
                gi.append(i)
                i += 1
            elif j < len(b):
                pj *= b[j]
                gj.append(j)
                j += 1
            elif i < len(a):
                pi *= a[i]
                gi.append(i)
                i += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def major_axis(axes, shape):
    """The first axis of a group with size > 1 (the one whose split keeps blocks contiguous)."""
    for x in axes:
        if shape[x] > 1:
            return x
    return None


def gather_maps(dn, op_nd, idx_nd, out_nd):
    """Where a gather's axes go (XLA's semantics; JAX puts the index vector last): ``window``
    {operand axis: output axis} for the axes sliced, not collapsed; ``index`` {indices axis:
    output axis} for the indices' batch axes, which fill the non-window output axes in order;
    ``index_of`` {operand batching axis: its paired indices axis}; ``batching`` {operand
    batching axis: output axis}, element i of the operand axis landing at output i."""
    skipped = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
    window = dict(zip([a for a in range(op_nd) if a not in skipped], dn.offset_dims))
    index = dict(zip(range(idx_nd - 1), [o for o in range(out_nd) if o not in dn.offset_dims]))
    index_of = dict(zip(dn.operand_batching_dims, dn.start_indices_batching_dims))
    return {"window": window, "index": index, "index_of": index_of,
            "batching": {a: index[i] for a, i in index_of.items()}}


def scatter_maps(dn, op_shape, upd_shape):
    """The operand axes a split may pass through a scatter on, with their copies in the other
    inputs: ``index_of`` {operand batching axis: its paired indices axis}; ``updates_of``
    {operand axis: updates axis} for the batching axes (the indices' batch axes fill the
    non-window updates axes in order) and the window axes the updates cover whole (window axes
    are the operand's axes neither inserted nor batching, in order)."""
    skipped = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
    window = zip([a for a in range(len(op_shape)) if a not in skipped], dn.update_window_dims)
    scatter_axes = [u for u in range(len(upd_shape)) if u not in dn.update_window_dims]
    index_of = dict(zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims))
    updates_of = {a: scatter_axes[i] for a, i in index_of.items()}
    updates_of.update({a: u for a, u in window if upd_shape[u] == op_shape[a]})
    return {"index_of": index_of, "updates_of": updates_of}
