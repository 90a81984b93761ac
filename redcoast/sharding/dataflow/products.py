"""Rules for matmuls and convolutions, where splits are made: a parameter multiplied with a
replicated activation is column-parallel (its output axis split), one multiplied with an activation
split on the contracting axis is row-parallel (the output all-reduced).

A convolution is a dense layer over its channel axes, applied at every position: the kernel's O
axis (rhs_spec[0]) is a matmul's output axis, its I axis (rhs_spec[1]) the contracted one, so
Megatron's rules split output channels of one convolution and input channels of the next. A
grouped convolution (feature_group_count G) is G convolutions side by side: split by whole groups,
its input, kernel and output channels split alike.
"""

import math

from ..interpreter import output_axes
from ..split_ends import KEPT
from .values import CONST, Par, Rep, Split, all_axes, shape_of


def op_dot_general(flow, eqn, ins):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if not lc and not rc:
        return [broadcast_product(flow, eqn, ins)]
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    shapes = [shape_of(eqn.invars[0]), shape_of(eqn.invars[1])]
    out_nd = len(shape_of(eqn.outvars[0]))
    contract, batch = (lc, rc), (lb, rb)
    free = [[i for i in range(len(shapes[k])) if i not in contract[k] and i not in batch[k]]
            for k in (0, 1)]

    positions = output_axes(eqn)

    def out_axis(k, axis):
        return positions[(k, axis)]

    def role(k, axis):
        if axis in contract[k]:
            return "contract", contract[k].index(axis)
        if axis in batch[k]:
            return "batch", batch[k].index(axis)
        return "free", None

    l, r = ins
    if isinstance(l, Par) and isinstance(r, Par):
        return [CONST]
    if isinstance(l, Par) or isinstance(r, Par):
        w = 0 if isinstance(l, Par) else 1
        flow.weight_of.setdefault(eqn, set()).add((ins[w].leaf, ins[w].axes))
        return [param_matmul(flow, eqn, ins[w], ins[1 - w], w, shapes, contract, batch, free,
                             out_axis, role, out_nd)]
    # activation x activation (attention scores, per-head values, expert combine)
    splits = [(k, s) for k, s in enumerate(ins) if isinstance(s, Split)]
    if not splits:
        vary = any(s.vary for s in ins)
        return [Rep(all_axes(out_nd) if vary else frozenset())]
    origins = frozenset().union(*(s.origins for _, s in splits))
    roles = [(k, role(k, s.axis)) for k, s in splits]
    if len(splits) == 2:
        (_, ra), (_, rb2) = roles
        if ra == rb2 and ra[0] == "batch":
            return [Split(ra[1], origins)]
        bad = [s for (_, s), (_, r) in zip(splits, roles) if r[0] != "batch"] or [s for _, s in splits]
        flow.conflict_among(bad, "two activations split on axes other than a shared batch axis "
                               "meet in a matmul (e.g. head_dim in the attention scores)")
        return [Rep(all_axes(out_nd))]
    (k, s), (_, (kind, _)) = splits[0], roles[0]
    if kind == "batch":  # the other side is sliced locally (K/V heads repeated for GQA)
        return [Split(out_axis(k, s.axis), origins)]
    if kind == "contract":  # the other side is sliced locally; partial sums all-reduced
        flow.split_ends.note(origins, KEPT)
        flow.all_reduced(eqn)
        return [Rep(all_axes(out_nd))]  # (the expert combine of a MoE)
    flow.conflict(origins, "an activation split on a non-batch axis meets a replicated one in "
                           "a matmul (e.g. values split on head_dim)")
    return [Rep(all_axes(out_nd))]


def broadcast_product(flow, eqn, ins):
    """A ``dot_general`` that contracts nothing (an einsum that only multiplies: rotary
    embeddings written ``einsum("bslh,...sh->bslh", q, cos)``) is a broadcasting multiply:
    each output element is one element of each operand, so splits pass through as they do
    through ``q * cos``. Each operand is laid over the output's axes (where
    :func:`output_axes` puts its own, the others broadcast) and combined elementwise."""
    nd = len(shape_of(eqn.outvars[0]))
    positions = output_axes(eqn)
    full = []
    for k, s in enumerate(ins):
        to = {a: positions[(k, a)] for a in range(len(shape_of(eqn.invars[k])))}
        if isinstance(s, Split):
            s = Split(to[s.axis], s.origins)
        elif isinstance(s, Par):
            axes = [None] * nd
            for a, pa in enumerate(s.axes):
                axes[to[a]] = pa
            s = Par(s.leaf, tuple(axes))
        else:
            src = s.src and (s.src[0], {to[a]: pa for a, pa in s.src[1].items()}, s.src[2])
            s = Rep(frozenset(to[a] for a in s.vary), src, s.tainted)
        full.append(s)
    return flow.combine(full, nd)


def param_matmul(flow, eqn, w, x, wk, shapes, contract, batch, free, out_axis, role, out_nd):
    xk = 1 - wk
    n = flow.n
    leaf = w.leaf
    pshape = flow.shapes[leaf]
    flow.used.add(leaf)
    # if the output stays replicated, this parameter could still split its output axis to
    # follow a split it is added to (a LoRA B matrix next to its column-parallel base)
    src = (leaf, {out_axis(wk, a): w.axes[a] for a in free[wk] if w.axes[a] is not None},
           x.origins if isinstance(x, Split) else frozenset())
    if isinstance(x, Split):
        kind, pos = role(xk, x.axis)
        if kind == "contract":
            wa = contract[wk][pos]
            pa = w.axes[wa]
            if pa is None or leaf in flow.final or pshape[pa] % n:
                why = flow.final.get(leaf) or flow.undivisible.get(leaf) or "its layout hides the split axis"
                flow.conflict(x.origins, f"the next matmul's parameter cannot be split ({why})", taint=False)
                return Rep(all_axes(out_nd), src)
            if leaf in flow.wish and flow.wish[leaf] != pa:
                flow.conflict(x.origins, "the next matmul's parameter follows another split", taint=False)
                return Rep(all_axes(out_nd), src)
            if leaf in flow.decided and flow.decided[leaf][0] != pa:
                flow.conflict(x.origins, "the next matmul's parameter is split another way", taint=False)
            else:
                flow.decide(leaf, pa, "row")
            flow.all_reduced(eqn)
            flow.split_ends.note(x.origins, KEPT)
            # the row-parallel output is replicated in any placement, unless its input's
            # split is already in conflict (then the matmul may read it whole and split)
            flow.clean_out = not x.origins & flow.blamed.keys()
            return Rep(all_axes(out_nd), src)
        if kind == "batch":
            wa = batch[wk][pos]
            pa = w.axes[wa]
            if pa is not None and leaf not in flow.final and pshape[pa] % n == 0:
                flow.decide(leaf, pa, "batch")
            return Split(out_axis(xk, x.axis), x.origins)
        return Split(out_axis(xk, x.axis), x.origins)
    # x replicated
    if leaf in flow.final:
        return Rep(all_axes(out_nd), src)
    xc = contract[xk]
    if xc and not any(a in x.vary for a in xc) and x.vary:
        # a one-hot (data-constant along the contracted axis): the vocabulary-parallel lookup
        cands = [w.axes[a] for a in contract[wk] if w.axes[a] is not None and pshape[w.axes[a]] % n == 0]
        if cands:
            flow.candidates.setdefault(leaf, cands)
            i = flow.choice.get(leaf, 0)
            if i < len(cands) and flow.decide(leaf, cands[i], "embedding-vocab"):
                return Rep(all_axes(out_nd))
    cands = column_candidates(flow, leaf, w, shapes[wk], batch[wk], free[wk])
    i = flow.choice.get(leaf, 0)
    if i >= len(cands):
        return Rep(all_axes(out_nd), src)
    pa = cands[i]
    wa = w.axes.index(pa)
    if not flow.decide(leaf, pa, "batch" if wa in batch[wk] else "column"):
        return Rep(all_axes(out_nd))
    if wa not in batch[wk]:
        flow.split_ends.column(leaf, pshape[pa], math.prod(shapes[wk][a] for a in contract[wk]))
    return Split(out_axis(wk, wa), frozenset([leaf]))


def column_candidates(flow, leaf, w, wshape, wbatch, wfree):
    """Parameter axes to split when ``w`` reads a replicated activation, best first.

    Batch axes (experts) first, then output axes major-first (heads before head_dim, heads
    before the Q/K/V axis of a fused kernel when that does not divide); a choice that leads
    to a conflict (head_dim contracted in the attention scores) is replaced by the next.
    """
    n = flow.n
    pshape = flow.shapes[leaf]
    free = [a for a in wfree if w.axes[a] is not None]
    free.sort(key=lambda a: w.axes[a])
    order = [a for a in wbatch if w.axes[a] is not None] + free
    cands = [w.axes[a] for a in order if pshape[w.axes[a]] % n == 0 and wshape[a] % n == 0]
    if leaf in flow.wish and flow.wish[leaf] in [w.axes[a] for a in wfree + list(wbatch)]:
        cands = [flow.wish[leaf]] + [c for c in cands if c != flow.wish[leaf]]
    if not cands and not order:
        flow.undivisible[leaf] = ("no output axis of its matmul is a whole axis of the parameter "
                                  f"(e.g. repeated before the matmul) that {n} shards can split")
    elif not cands:
        sizes = [pshape[w.axes[a]] for a in order]
        flow.undivisible[leaf] = (f"output dimension{'s' if len(sizes) > 1 else ''} "
                                  f"{', '.join(map(str, sizes))} not divisible by {n}")
    prev = flow.candidates.get(leaf)
    if prev is None or len(cands) > len(prev):
        flow.candidates[leaf] = cands
    return cands


def op_conv_general_dilated(flow, eqn, ins):
    """A convolution with a parameter kernel: row-parallel on an input split on its
    channels, column-parallel on a replicated one, grouped ones by whole groups."""
    x, w = ins
    if eqn.params["batch_group_count"] > 1 or not isinstance(w, Par) or isinstance(x, Par):
        # a kernel computed from data (or a batch-grouped one, as in a kernel gradient)
        return flow.unknown(eqn, ins, "a convolution whose kernel is not a parameter")
    dn = eqn.params["dimension_numbers"]
    out_nd = len(shape_of(eqn.outvars[0]))
    flow.used.add(w.leaf)
    flow.channel_widths.update((shape_of(eqn.invars[0])[dn.lhs_spec[1]],
                                shape_of(eqn.outvars[0])[dn.out_spec[1]]))
    if isinstance(x, Split) and x.axis != dn.lhs_spec[1]:
        if x.axis == dn.lhs_spec[0]:  # split over the batch: every example convolved alone
            return [Split(dn.out_spec[0], x.origins)]
        flow.conflict(x.origins, "a convolution's window runs over its split (spatial) axis")
        return [Rep(all_axes(out_nd))]
    if eqn.params["feature_group_count"] > 1:
        return [grouped_conv(flow, eqn, x, w, dn, out_nd)]
    if isinstance(x, Split):  # input channels split: row-parallel, the output all-reduced
        return [conv_row(flow, eqn, x, w, dn, out_nd)]
    return [conv_column(flow, eqn, w, dn, out_nd, "column")]


def _conv_axis(flow, eqn, w, kernel_axis):
    """The parameter axis of the kernel's ``kernel_axis`` if ``flow.n`` shards divide it
    (as the kernel is stored and as the convolution sees it), else None."""
    pa = w.axes[kernel_axis]
    if pa is None or flow.shapes[w.leaf][pa] % flow.n or shape_of(eqn.invars[1])[kernel_axis] % flow.n:
        return None
    return pa


def conv_row(flow, eqn, x, w, dn, out_nd):
    """A convolution reading input channels split over the shards: its kernel's I axis is
    split to match, each shard sums its channels, the output is all-reduced (replicated)."""
    leaf = w.leaf
    src = _conv_src(flow, w, dn, x.origins)
    pa = _conv_axis(flow, eqn, w, dn.rhs_spec[1])
    if pa is None or leaf in flow.final:
        why = (flow.final.get(leaf) or flow.undivisible.get(leaf)
               or f"its input channels ({shape_of(eqn.invars[1])[dn.rhs_spec[1]]}) are not "
                  f"divisible by {flow.n}")
        flow.conflict(x.origins, f"the next convolution's kernel cannot be split ({why})", taint=False)
        return Rep(all_axes(out_nd), src)
    if leaf in flow.wish and flow.wish[leaf] != pa:
        flow.conflict(x.origins, "a convolution reading it is asked to split its output channels "
                                 "instead, to follow a split it is added to", taint=False)
        return Rep(all_axes(out_nd), src)
    if leaf in flow.decided and flow.decided[leaf][0] != pa:
        flow.conflict(x.origins, "the next convolution's kernel is split another way", taint=False)
    else:
        flow.decide(leaf, pa, "row")
    flow.all_reduced(eqn)
    flow.split_ends.note(x.origins, KEPT)
    flow.clean_out = not x.origins & flow.blamed.keys()  # as param_matmul's row case
    return Rep(all_axes(out_nd), src)


def _conv_src(flow, w, dn, upstream):
    """A replicated convolution output's ``Rep.src``: the kernel could split its output
    channels to follow a split it is added to (a projection shortcut beside a block), as
    :meth:`residual_meet` weighs against giving up the splits upstream."""
    pa = w.axes[dn.rhs_spec[0]]
    return None if pa is None else (w.leaf, {dn.out_spec[1]: pa}, upstream)


def conv_column(flow, eqn, w, dn, out_nd, kind):
    """A convolution reading a replicated input: split its output channels (the kernel's O
    axis) if they divide, the output split on its feature axis; else replicated."""
    leaf = w.leaf
    src = _conv_src(flow, w, dn, frozenset())
    if leaf in flow.final:
        return Rep(all_axes(out_nd), src)
    pa = _conv_axis(flow, eqn, w, dn.rhs_spec[0])
    cands = [] if pa is None else [pa]
    if leaf in flow.wish and flow.wish[leaf] == pa:  # asked to follow a split: nothing else
        cands = [pa]
    if not cands and leaf not in flow.undivisible:
        flow.undivisible[leaf] = (f"output channels {shape_of(eqn.invars[1])[dn.rhs_spec[0]]} "
                                  f"not divisible by {flow.n}")
    if len(cands) > len(flow.candidates.get(leaf, ())):
        flow.candidates[leaf] = cands
    if flow.choice.get(leaf, 0) >= len(cands):
        return Rep(all_axes(out_nd), src)
    if not flow.decide(leaf, pa, kind):
        return Rep(all_axes(out_nd))
    return Split(dn.out_spec[1], frozenset([leaf]))


def grouped_conv(flow, eqn, x, w, dn, out_nd):
    """A grouped convolution, split by whole groups when the shards divide them: input,
    kernel O and output channels split alike, no communication. On a replicated input
    it starts a split as a column-parallel layer does; on a split one it carries it on."""
    leaf, groups = w.leaf, eqn.params["feature_group_count"]
    if groups % flow.n:
        flow.undivisible[leaf] = (f"a grouped convolution of {groups} groups, not divisible "
                                  f"by {flow.n} shards")
        if isinstance(x, Split):
            flow.conflict(x.origins, f"the next convolution's kernel cannot be split "
                                     f"({flow.undivisible[leaf]})", taint=False)
        return Rep(all_axes(out_nd))
    if not isinstance(x, Split):
        return conv_column(flow, eqn, w, dn, out_nd, "conv-groups")
    pa = _conv_axis(flow, eqn, w, dn.rhs_spec[0])  # O = groups x outputs per group: divides
    if pa is None or leaf in flow.final:
        why = flow.final.get(leaf) or "its layout hides the output channels"
        flow.conflict(x.origins, f"the next grouped convolution's kernel cannot be split ({why})",
                      taint=False)
        return Rep(all_axes(out_nd))
    if leaf in flow.decided and flow.decided[leaf][0] != pa:
        flow.conflict(x.origins, "the next grouped convolution's kernel is split another way",
                      taint=False)
        return Rep(all_axes(out_nd))
    flow.decide(leaf, pa, "conv-groups")
    return Split(dn.out_spec[1], x.origins)


def _pool(flow, eqn, ins):
    """A pooling window (avg_pool, max_pool): each channel pooled alone, so a split on an
    axis the window neither spans, strides, dilates nor pads passes through."""
    p = eqn.params
    full = [p["window_dimensions"][i] == 1 and p["window_strides"][i] == 1
            and tuple(p["padding"][i]) == (0, 0) and p["base_dilation"][i] == 1
            and p["window_dilation"][i] == 1 for i in range(len(shape_of(eqn.invars[0])))]
    return [flow.slice_like(eqn, ins[0], full)]


RULES = {
    "conv_general_dilated": op_conv_general_dilated,
    "dot_general": op_dot_general,
    "reduce_window_max": _pool,
    "reduce_window_min": _pool,
    "reduce_window_sum": _pool,
}
