"""Rules for gathers and scatters: lookups into a parameter (an embedding: vocabulary split when
it divides, else hidden), per-head gathers whose heads are a batching axis, scatter-adds (an
embedding's gradient)."""

from ..split_ends import REDUCED
from .values import Par, Rep, Split, all_axes, gather_maps, scatter_maps, shape_of


def op_gather(flow, eqn, ins):
    op, idx = ins[0], ins[1]
    dn = eqn.params["dimension_numbers"]
    op_shape, out_shape = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    nd = len(out_shape)
    slice_sizes = eqn.params["slice_sizes"]
    m = gather_maps(dn, len(op_shape), len(shape_of(eqn.invars[1])), nd)
    offset_map = m["window"]  # operand axis -> output axis (a slice of it)
    if isinstance(idx, Split):
        return [_split_indices(flow, eqn, op, idx, m)]
    data = bool(idx.vary)
    if isinstance(op, Par):
        indexed = [a for a in dn.start_index_map]
        if not data:  # a constant index: a layer of a stacked parameter, a position table
            axes = [None] * nd
            for a, o in offset_map.items():
                if slice_sizes[a] == op_shape[a]:
                    axes[o] = op.axes[a]
            for a, o in m["batching"].items():  # element i of the axis goes to output i
                axes[o] = op.axes[a]
            return [Par(op.leaf, tuple(axes))]
        embedding(flow, op, indexed, offset_map, op_shape, slice_sizes)
        if flow.decided.get(op.leaf, (None, None))[1] == "embedding-vocab":
            flow.all_reduced(eqn)  # each shard looks up its rows, zeros elsewhere: summed
        return [Rep(all_axes(nd))]
    if isinstance(op, Split):
        a = op.axis
        if a in m["batching"]:  # per-head blocks gathered per head (vmap, take_along_axis)
            return [Split(m["batching"][a], op.origins)]
        if a in offset_map and slice_sizes[a] == op_shape[a]:
            return [Split(offset_map[a], op.origins)]
        if a in dn.start_index_map or a in dn.collapsed_slice_dims:
            flow.split_ends.note(op.origins, REDUCED)
            flow.all_reduced(eqn)
            return [Rep(all_axes(nd))]  # a pick along the split axis: XLA masks and all-reduces
        flow.conflict(op.origins, "it is gathered along its split axis")
        return [Rep(all_axes(nd))]
    return [Rep(all_axes(nd) if (op.vary or data) else frozenset())]


def _split_indices(flow, eqn, op, idx, m):
    """Gather indices split along one of their batch axes: each shard gathers its own rows,
    from an operand that is replicated or split along the paired batching axis."""
    nd = len(shape_of(eqn.outvars[0]))
    o = m["index"].get(idx.axis)  # None: the index vector axis
    paired = {i: a for a, i in m["index_of"].items()}.get(idx.axis)
    if o is not None and isinstance(op, Rep):  # each shard gathers from its whole copy
        return Split(o, idx.origins)
    if o is not None and isinstance(op, Split) and op.axis == paired:
        return Split(o, idx.origins | op.origins)
    flow.conflict(idx.origins, "it is used as gather indices")
    if isinstance(op, Split):
        flow.conflict(op.origins, "it is gathered by indices split another way")
    return Rep(all_axes(nd))


def embedding(flow, op, indexed, offset_map, op_shape, slice_sizes):
    """A parameter looked up by data-dependent indices: split the vocabulary, else hidden."""
    n = flow.n
    leaf = op.leaf
    if leaf in flow.final:
        return
    cands = [op.axes[a] for a in indexed if op.axes[a] is not None and op_shape[a] % n == 0]
    kind = "embedding-vocab"
    rows = min((op_shape[a] for a in indexed), default=0)
    if not cands and rows < n:
        # a table of fewer rows than shards (token types, segments) is tiny: split on hidden
        # it would split the stream it is added to (measured: BERT 1.6x Megatron's traffic)
        flow.undivisible[leaf] = (f"an embedding of {rows} rows, fewer than the {n} model "
                                  "shards: too small to split")
        return
    if not cands:
        cands = [op.axes[a] for a in offset_map if op.axes[a] is not None
                 and slice_sizes[a] == op_shape[a] and op_shape[a] % n == 0]
        kind = "embedding-hidden"
    if not cands:
        flow.undivisible[leaf] = (f"embedding dimensions {tuple(op_shape)} are not divisible by {n}")
        return
    if leaf in flow.decided and flow.decided[leaf][0] in cands:
        return
    flow.candidates.setdefault(leaf, cands)
    i = flow.choice.get(leaf, 0)
    if i < len(cands):
        flow.decide(leaf, cands[i], kind)


def op_scatter_add(flow, eqn, ins):
    """scatter, scatter-add/mul/min/max: the output is the operand with the updates written
    in. A split passes through on an operand axis that the updates cover whole (a window
    axis) or element by element (a batching axis, as vmap writes per head), when the operand
    and the updates are each split along their copy of that axis or constant along it, and
    the indices are split along their copy (a batching axis) or not split."""
    op_shape = shape_of(eqn.invars[0])
    nd = len(op_shape)
    m = scatter_maps(eqn.params["dimension_numbers"], op_shape, shape_of(eqn.invars[2]))
    copies = [{a: a for a in range(nd)}, m["index_of"], m["updates_of"]]  # operand axis -> own
    splits = [(k, s) for k, s in enumerate(ins[:3]) if isinstance(s, Split)]
    if not splits:
        data = any(isinstance(s, Rep) and s.vary for s in ins[:3])
        return [Rep(all_axes(nd) if data else frozenset())]
    origins = frozenset().union(*(s.origins for _, s in splits))
    targets = {next((a for a, c in copies[k].items() if c == s.axis), None) for k, s in splits}
    a = targets.pop() if len(targets) == 1 else None
    if a is None or a not in copies[2]:
        flow.conflict(origins, "its split output is scattered along its split axis")
        return [Rep(all_axes(nd))]
    for k in (0, 2):  # operand, updates
        s = ins[k]
        if isinstance(s, Rep) and copies[k][a] in s.vary:
            flow.conflict(origins, "its split output is scattered into (or with) a replicated "
                                   "activation, which would need an all-gather")
            return [Rep(all_axes(nd))]
    return [Split(a, origins)]


RULES = {
    "gather": op_gather,
    "scatter": op_scatter_add,
    "scatter_add": op_scatter_add,
    "scatter_max": op_scatter_add,
    "scatter_min": op_scatter_add,
    "scatter_mul": op_scatter_add,
}
