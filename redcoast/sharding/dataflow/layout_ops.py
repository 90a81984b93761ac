"""Rules for operations that move, cut, join or reduce a value: transposes, reshapes, broadcasts,
slices, pads, concatenations, stacks, reductions, sorts. A split passes where its axis stays whole;
cutting, joining along it or reducing it over the model width is a conflict."""

from ..split_ends import KEPT, REDUCED
from .values import CONST, Par, Rep, Split, all_axes, major_axis, reshape_groups, shape_of


def op_transpose(flow, eqn, ins):
    (s,) = ins
    perm = eqn.params["permutation"]
    if isinstance(s, Split):
        return [Split(list(perm).index(s.axis), s.origins)]
    if isinstance(s, Par):
        return [Par(s.leaf, tuple(s.axes[p] for p in perm))]
    src = None
    if s.src is not None:
        src = (s.src[0], {list(perm).index(k): v for k, v in s.src[1].items()}, s.src[2])
    return [Rep(frozenset(list(perm).index(a) for a in s.vary), src)]


def op_reshape(flow, eqn, ins):
    (s,) = ins[:1]
    a_shape, b_shape = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    groups = reshape_groups(a_shape, b_shape)
    if isinstance(s, Split):
        for gi, gj in groups:
            if s.axis in gi:
                if major_axis(gi, a_shape) == s.axis:
                    o = major_axis(gj, b_shape)
                    if o is not None and b_shape[o] % flow.n == 0:
                        return [Split(o, s.origins)]
                flow.conflict(s.origins, f"a reshape {a_shape} -> {b_shape} breaks its split axis "
                                         "(e.g. a fused Q/K/V written as one matrix)")
                return [Rep(all_axes(len(b_shape)))]
    if isinstance(s, Par):
        axes = [None] * len(b_shape)
        for gi, gj in groups:
            i, j = major_axis(gi, a_shape), major_axis(gj, b_shape)
            if i is None or j is None:
                continue
            merged = [x for x in gi if a_shape[x] > 1]
            # axes merged into one: a split of the result in n blocks is a split of the
            # parameter axis of the major one only if that one divides (a K weight repeated
            # by hand, (kv, group, head_dim) merged: n > kv would cut head_dim)
            if any(s.axes[x] != s.axes[i] for x in merged) and a_shape[i] % flow.n:
                continue
            axes[j] = s.axes[i]
        return [Par(s.leaf, tuple(axes))]
    vary = set()
    for gi, gj in groups:
        if any(x in s.vary for x in gi):
            vary |= {j for j in gj if b_shape[j] > 1}
    return [Rep(frozenset(vary))]


def op_squeeze(flow, eqn, ins):
    (s,) = ins
    dims = set(d % len(shape_of(eqn.invars[0])) for d in eqn.params["dimensions"])
    keep = [i for i in range(len(shape_of(eqn.invars[0]))) if i not in dims]
    if isinstance(s, Split):
        return [Split(keep.index(s.axis), s.origins)]
    if isinstance(s, Par):
        return [Par(s.leaf, tuple(s.axes[i] for i in keep))]
    return [Rep(frozenset(keep.index(a) for a in s.vary if a in keep))]


def op_expand_dims(flow, eqn, ins):
    return op_reshape(flow, eqn, ins)


def op_broadcast_in_dim(flow, eqn, ins):
    s = ins[0]
    a_shape, b_shape = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    bd = eqn.params["broadcast_dimensions"]
    same = [a_shape[i] == b_shape[bd[i]] for i in range(len(a_shape))]
    if isinstance(s, Split):
        return [Split(bd[s.axis], s.origins)]
    if isinstance(s, Par):
        axes = [None] * len(b_shape)
        for i, d in enumerate(bd):
            if same[i]:
                axes[d] = s.axes[i]
        return [Par(s.leaf, tuple(axes))]
    return [Rep(frozenset(bd[i] for i in s.vary if same[i] and b_shape[bd[i]] > 1))]


def op_slice(flow, eqn, ins):
    shp = shape_of(eqn.invars[0])
    lo, hi, st = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.params["strides"]
    full = [lo[i] == 0 and hi[i] == shp[i] and (st is None or st[i] == 1) for i in range(len(shp))]
    return [flow.slice_like(eqn, ins[0], full)]


def op_dynamic_slice(flow, eqn, ins):
    shp = shape_of(eqn.invars[0])
    sizes = eqn.params["slice_sizes"]
    return [flow.slice_like(eqn, ins[0], [sizes[i] == shp[i] for i in range(len(shp))])]


def op_split(flow, eqn, ins):
    shp = shape_of(eqn.invars[0])
    axis = eqn.params["axis"] % len(shp)
    # one piece is the whole operand (``(q,) = jnp.split(x, 1, axis)``): an identity
    full = [i != axis or len(eqn.outvars) == 1 for i in range(len(shp))]
    return [flow.slice_like(eqn, ins[0], full) for _ in eqn.outvars]


def op_rev(flow, eqn, ins):
    dims = eqn.params["dimensions"]
    return [flow.slice_like(eqn, ins[0], [i not in dims for i in range(len(shape_of(eqn.invars[0])))])]


def op_pad(flow, eqn, ins):
    cfg = eqn.params["padding_config"]
    s = flow.slice_like(eqn, ins[0], [tuple(c) == (0, 0, 0) for c in cfg])
    if isinstance(s, Par):
        s = CONST
    return [s]


def _joined(flow, ins, along, nd, what):
    """Operands joined along their axis ``along``: a split passes through when every operand
    is split the same way on another axis (each shard joins its own pieces); else None."""
    splits = [s for s in ins if isinstance(s, Split)]
    if not splits:
        return None
    origins = frozenset().union(*(s.origins for s in splits))
    axes = {s.axis for s in splits}
    if len(axes) > 1 or along in axes or len(splits) != len(ins):
        flow.conflict(origins, f"its split output is {what} with others along its split axis "
                               "or with values split another way")
        return Rep(all_axes(nd))
    return Split(axes.pop(), origins)


def op_concatenate(flow, eqn, ins):
    d = eqn.params["dimension"]
    nd = len(shape_of(eqn.outvars[0]))
    joined = _joined(flow, ins, d, nd, "concatenated")
    if joined is not None:
        return [joined]
    # a concatenation of parameters is used as a replicated constant
    vary = frozenset().union(*(s.vary for s in ins if isinstance(s, Rep)))
    return [Rep(vary | ({d} if vary else frozenset()))]


def op_stack(flow, eqn, ins):
    """``jnp.stack`` (jax's 'stack' primitive): the operands join along a new axis, so the
    output's axes from ``axis`` on are one further than the operands'."""
    d = eqn.params["axis"]
    nd = len(shape_of(eqn.outvars[0]))
    shift = lambda a: a + 1 if a >= d else a  # noqa: E731
    joined = _joined(flow, ins, None, nd, "stacked")
    if isinstance(joined, Split):
        return [Split(shift(joined.axis), joined.origins)]
    if joined is not None:
        return [joined]
    vary = frozenset(shift(a) for s in ins if isinstance(s, Rep) for a in s.vary)
    return [Rep(vary | ({d} if vary else frozenset()))]


def op_unstack(flow, eqn, ins):
    """``jnp.unstack`` (stack's transpose): one output per index of ``axis``, that axis gone."""
    (s,) = ins
    d = eqn.params["axis"]
    keep = [i for i in range(len(shape_of(eqn.invars[0]))) if i != d]
    if isinstance(s, Split) and s.axis == d:
        flow.conflict(s.origins, "its split output is cut into pieces along its split axis (unstack)")
        return [Rep(all_axes(len(keep))) for _ in eqn.outvars]
    if isinstance(s, Split):
        return [Split(keep.index(s.axis), s.origins) for _ in eqn.outvars]
    if isinstance(s, Par):  # one layer of a stacked parameter
        return [Par(s.leaf, tuple(s.axes[i] for i in keep)) for _ in eqn.outvars]
    return [Rep(frozenset(keep.index(a) for a in s.vary if a != d)) for _ in eqn.outvars]


def op_dynamic_update_slice(flow, eqn, ins):
    op, upd = ins[0], ins[1]
    nd = len(shape_of(eqn.outvars[0]))
    if isinstance(op, Split) or isinstance(upd, Split):
        a = op.axis if isinstance(op, Split) else upd.axis
        full = shape_of(eqn.invars[0])[a] == shape_of(eqn.invars[1])[a]
        if isinstance(op, Split) and isinstance(upd, Split) and op.axis == upd.axis and full:
            return [Split(a, op.origins | upd.origins)]
        origins = frozenset().union(*(s.origins for s in (op, upd) if isinstance(s, Split)))
        flow.conflict(origins, "its split output is written into a replicated buffer")
        return [Rep(all_axes(nd))]
    vary = frozenset().union(*(s.vary for s in (op, upd) if isinstance(s, Rep)))
    return [Rep(all_axes(nd) if vary else frozenset())]


def op_iota(flow, eqn, ins):
    return [CONST]


def _reduce(flow, eqn, s, axes, what):
    nd_in = len(shape_of(eqn.invars[0]))
    keep = [i for i in range(nd_in) if i not in axes]
    if isinstance(s, Split):
        if s.axis in axes:
            size = shape_of(eqn.invars[0])[s.axis]
            if size == flow.width or size in flow.channel_widths:
                flow.conflict(s.origins, f"it is reduced over the model width ({what}, e.g. a norm)",
                              taint=False)
            # reduced to a scalar (a loss) ends the program; per-token values left are the
            # reductions a split of a router's scores would pay for
            whole = all(shape_of(eqn.invars[0])[a] == 1 for a in keep)
            flow.split_ends.note(s.origins, KEPT if whole else REDUCED)
            flow.all_reduced(eqn)
            return Rep(all_axes(len(keep)))
        return Split(keep.index(s.axis), s.origins)
    if isinstance(s, Par):
        return CONST
    return Rep(frozenset(keep.index(a) for a in s.vary if a in keep))


def _reduce_op(flow, eqn, ins):
    axes = tuple(a % len(shape_of(eqn.invars[0])) for a in eqn.params["axes"])
    return [_reduce(flow, eqn, ins[0], axes, eqn.primitive.name)]


def _cumulative(flow, eqn, ins):
    axis = eqn.params["axis"]
    return [flow.slice_like(eqn, ins[0], [i != axis for i in range(len(shape_of(eqn.invars[0])))])]


def op_sort(flow, eqn, ins):
    dim = eqn.params["dimension"]
    full = [i != dim for i in range(len(shape_of(eqn.invars[0])))]
    return [flow.slice_like(eqn, s, full) for s in ins]


def op_top_k(flow, eqn, ins):
    nd = len(shape_of(eqn.invars[0]))
    out = flow.slice_like(eqn, ins[0], [i != nd - 1 for i in range(nd)])
    return [out, out if isinstance(out, Split) else Rep(out.vary if isinstance(out, Rep) else frozenset())]


RULES = {
    "argmax": _reduce_op,
    "argmin": _reduce_op,
    "broadcast_in_dim": op_broadcast_in_dim,
    "concatenate": op_concatenate,
    "cumlogsumexp": _cumulative,
    "cummax": _cumulative,
    "cummin": _cumulative,
    "cumprod": _cumulative,
    "cumsum": _cumulative,
    "dynamic_slice": op_dynamic_slice,
    "dynamic_update_slice": op_dynamic_update_slice,
    "expand_dims": op_expand_dims,
    "iota": op_iota,
    "pad": op_pad,
    "reduce_and": _reduce_op,
    "reduce_max": _reduce_op,
    "reduce_min": _reduce_op,
    "reduce_or": _reduce_op,
    "reduce_prod": _reduce_op,
    "reduce_sum": _reduce_op,
    "reduce_xor": _reduce_op,
    "reshape": op_reshape,
    "rev": op_rev,
    "slice": op_slice,
    "sort": op_sort,
    "split": op_split,
    "squeeze": op_squeeze,
    "stack": op_stack,
    "top_k": op_top_k,
    "transpose": op_transpose,
    "unstack": op_unstack,
}
