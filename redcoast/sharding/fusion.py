"""Running a tensor-parallel plan at Megatron-LM's traffic: rewrites of the traced function.

Under a plan from :mod:`.dataflow`, XLA inserts one all-reduce per matmul whose output is a partial
sum over the model shards. These rewrites of the user's function (same math, up to floating-point
summation order) bring that down to Megatron's count:

* sibling matmuls that share an input (Q, K, V; gate and up) run as one matmul, so the backward
  pass sums their input gradients locally and all-reduces once;
* a matmul whose partial-sum output only feeds another contraction (an MoE's gate-weighted sum
  of its experts' outputs) is reassociated, so that the sum over shards happens once, on the
  smaller result;
* the replicated operand of a contraction over a split matmul's output axis (the gates of split
  MoE experts) is pinned whole along that axis, so that XLA does not split what computed it;
* grouped-query K/V that the plan replicates (or keeps by groups of shards) are projected from a
  weight repeated so that every shard computes its own K/V heads, once each (kv_repeat.py), so
  that they join Q's fused matmul;
* a lookup into a table the plan splits along its hidden axis (its vocabulary does not divide
  the shards) is gathered whole right away, so that the split does not spread into the residual
  stream the looked-up rows join.

What the rewrites know of the plan comes in one argument, a :class:`~.rewrite_plan.RewritePlan`;
a matmul's weight is recognised by the parameter its variable carries (weight_origins.py), so two
weights of one shape placed differently are told apart.
"""

import string

import jax
import numpy as np
from jax.extend import core as jcore

from . import kv_repeat, weight_origins
from .interpreter import (CALLS, bind, evaluate, evaluate_on_demand, follow, output_axes,
                          producers, read_once, readers, rerun_inside, where)
from .paths import leaves_with_paths
from .rewrite_plan import RewritePlan, WeightSplit



def _is_dot(eqn):
    return eqn.primitive.name == "dot_general"


def _split_along(plan, origins, v, axes):
    """Whether ``v`` is a weight the plan splits over the model shards along one of ``axes``:
    a parameter (or a view of one, weight_origins.py) whose placement splits that axis; with the
    plan unknown, any operand. A matmul is fused only if its weight is split along a free axis:
    fusing replicated weights makes XLA move more (measured: GQA with K/V replicated, 1.08x ->
    1.21x)."""
    if not plan.knows_placements:
        return True
    origin = weight_origins.of(origins, v)
    return origin is not None and origin.split_along(axes)


def _split_by_groups(origins, v, axis):
    """Whether the plan splits weight ``v`` along ``axis`` over groups of the model shards."""
    origin = weight_origins.of(origins, v)
    return origin is not None and origin.split_by_groups(axis)


def _free_axes(eqn, side):
    """The free (neither contracted nor batch) axes of the non-shared operand."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    other = eqn.invars[1 - side]
    bound = set(rc) | set(rb) if side == 0 else set(lc) | set(lb)
    return [d for d in range(len(other.aval.shape)) if d not in bound]


def _sibling_key(eqn, plan, origins):
    """Matmuls that share one operand (the same variable, same side, same dimension numbers) can
    run as one matmul: over the stacked others when those have one shape, or (with ``blocks``
    model shards) over the others concatenated block-wise along a free axis (the heads of a
    grouped-query Q beside K and V) whose size ``blocks`` divides in each. Only weights the
    plan splits along that axis (``origins``: which variables carry which parameter)."""
    blocks = plan.blocks
    if eqn.primitive.name != "dot_general":
        return None
    a, b = eqn.invars
    params = tuple(sorted((k, str(v)) for k, v in eqn.params.items()))
    for side, (shared, other) in enumerate(((a, b), (b, a))):
        if isinstance(shared, jcore.Var) and isinstance(other, jcore.Var):
            shape, dtype = tuple(other.aval.shape), str(other.aval.dtype)
            free_axes = _free_axes(eqn, side)
            if _split_along(plan, origins, other, free_axes):
                yield ("stack", id(shared), side, params, shape, dtype)
            for free in (free_axes if blocks > 1 else ()):
                if shape[free] % blocks == 0 and _split_along(plan, origins, other, [free]):
                    masked = shape[:free] + (None,) + shape[free + 1:]
                    yield ("concat", id(shared), side, params, masked, dtype, free)


def _groups(jaxpr, plan, origins):
    """{eqn index: (group eqn indices, side, how)} for sibling matmuls of one jaxpr (groups of
    2+); ``how`` is "stack" or the free axis to concatenate along. The largest groups win;
    among equal ones, stacking (one shape) before concatenating."""
    by_key = {}
    for i, eqn in where(jaxpr, _is_dot):
        for key in _sibling_key(eqn, plan, origins) or ():
            by_key.setdefault(key, []).append(i)
    taken, out = set(), {}
    for key, members in sorted(by_key.items(), key=lambda kv: (-len(kv[1]), kv[0][0] != "stack")):
        members = [m for m in members if m not in taken]
        if len(members) > 1:
            how = "stack" if key[0] == "stack" else key[6]
            for m in members:
                out[m] = (members, key[2], how)
            taken.update(members)
    return out


def _dot_labels(eqn, lhs, rhs):
    """Einsum labels of a dot_general: operand labels with contracted and batch pairs tied, and
    the output's (batch axes, then lhs free, then rhs free)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    rhs = list(rhs)
    for i, j in zip(list(lc) + list(lb), list(rc) + list(rb)):
        rhs[j] = lhs[i]
    out = [lhs[i] for i in lb] + [x for i, x in enumerate(lhs) if i not in lc and i not in lb] \
        + [x for j, x in enumerate(rhs) if j not in rc and j not in rb]
    return list(lhs), rhs, out


def _partial_chains(jaxpr, groups, plan, origins):
    """{index of a contraction: (index of the row-parallel matmul feeding it, index of the
    transpose between them or None, side of the weight)}.

    The first matmul contracts a weight along its split axis, so its output is a partial sum that
    XLA all-reduces at once; when that output (possibly transposed) is read only by a second
    contraction that makes it smaller (an MoE's ``einsum('bted,bte->btd', expert_out, gates)``),
    both run as one: the gates are applied to the first matmul's other operand and the weight is
    contracted over its split axis and the experts together, so one all-reduce of the small result
    remains. Only when the weights the plan splits are known, and never when it would build an
    operand larger than the tensors it replaces.
    """
    if not plan.knows_placements:
        return {}
    uses, producer = readers(jaxpr), producers(jaxpr)
    out = {}
    for k, eqn in where(jaxpr, _is_dot):
        for side2, v in enumerate(eqn.invars):
            chain = _row_parallel_source(jaxpr, v, uses, producer, groups, plan, origins)
            if chain is not None and _reassociation(jaxpr, k, side2, *chain) is not None:
                out[k] = (side2, *chain)
                break
    return out


def _row_parallel_source(jaxpr, v, uses, producer, groups, plan, origins):
    """(matmul index, transpose index or None, weight side) when ``v`` is read once and is the
    output (possibly transposed once) of a matmul contracting a split weight."""
    if not isinstance(v, jcore.Var) or not read_once(v, uses) or v not in producer:
        return None
    t, i = None, producer[v]
    if jaxpr.eqns[i].primitive.name == "transpose":
        src = jaxpr.eqns[i].invars[0]
        if not isinstance(src, jcore.Var) or not read_once(src, uses) or src not in producer:
            return None
        t, i = i, producer[src]
    eqn = jaxpr.eqns[i]
    if eqn.primitive.name != "dot_general" or i in groups:
        return None
    (lc, rc), _ = eqn.params["dimension_numbers"]
    for side, contract in ((0, lc), (1, rc)):
        w = eqn.invars[side]
        if isinstance(w, jcore.Var) and contract and _split_along(plan, origins, w, contract):
            return i, t, side
    return None


def _reassociation(jaxpr, k, side2, i, t, wside):
    """The two einsum specs (x = a * g; out = x . w) that compute contraction ``k`` from the
    operands of matmul ``i``, or None when that would not shrink the all-reduced tensor or
    would need an operand larger than those it replaces."""
    first, second = jaxpr.eqns[i], jaxpr.eqns[k]
    letters = iter(string.ascii_letters)
    fresh = lambda v: [next(letters) for _ in v.aval.shape]  # noqa: E731
    l0, l1, partial = _dot_labels(first, fresh(first.invars[0]), fresh(first.invars[1]))
    if t is not None:
        partial = [partial[p] for p in jaxpr.eqns[t].params["permutation"]]
    other = second.invars[1 - side2]
    lo = fresh(other)
    if side2 == 0:
        _, lo, lout = _dot_labels(second, partial, lo)
    else:
        lo, _, lout = _dot_labels(second, lo, partial)
    la, lw = (l1, l0) if wside == 0 else (l0, l1)
    a, w = first.invars[1 - wside], first.invars[wside]
    if set(lo) - set(la) - set(lw):  # the other operand brings axes of its own: not a gate
        return None
    lx = [x for x in dict.fromkeys(la + lo) if x in lw or x in lout]
    sizes = {x: n for v, ls in ((a, la), (w, lw), (other, lo)) for x, n in zip(ls, v.aval.shape)}
    size = lambda ls: int(np.prod([sizes[x] for x in ls]))  # noqa: E731
    if size(lout) >= size(partial) or size(lx) > max(size(la), size(partial)):
        return None
    return (f"{''.join(la)},{''.join(lo)}->{''.join(lx)}", f"{''.join(lx)},{''.join(lw)}->{''.join(lout)}",
            a, other, w)


def _gate_operands(jaxpr, plan, origins):
    """{index of a contraction: side of its operand to pin replicated}: contractions over the
    split axis of a column-split matmul's output (experts of an MoE weighted by their gates),
    whose other operand is an activation the plan keeps replicated. Pinned, XLA slices it locally
    instead of splitting the computation that made it (the router's softmax and top-k)."""
    if plan.mesh is None or not plan.knows_placements:
        return {}
    producer = producers(jaxpr)
    out = {}
    for k, eqn in where(jaxpr, _is_dot):
        (lc, rc), _ = eqn.params["dimension_numbers"]
        for side, contract in ((0, lc), (1, rc)):
            axes = _split_output_axes(jaxpr, eqn.invars[side], producer, plan, origins)
            other = eqn.invars[1 - side]
            made_by = jaxpr.eqns[producer[other]].primitive.name if other in producer else None
            if axes & set(contract) and isinstance(other, jcore.Var) and made_by not in (None, "dot_general"):
                out[k] = (1 - side, tuple(rc if side == 0 else lc))  # its contracted axes
    return out


def _routing(jaxpr, plan, origins):
    """Positions of the equations that compute an MoE's routing: from a router's scores (a
    weight the plan keeps whole as a router, rules.Placement.routes) and constants alone, up to
    the matmuls that use it (dispatch, combine: not included). Left to XLA, the experts' split
    spreads back from those matmuls into the softmax, arg-max and masks, each reduction over the
    experts then a collective (GShard's top-2 on 4 shards: 1.24x Megatron's bytes per layer;
    pinning only the router's output or the dispatch/combine operands: 1.27-1.30x). Pinned
    whole, each shard slices its experts' part of dispatch and combine locally."""
    if plan.mesh is None or not plan.knows_placements:
        return set()
    position, out = producers(jaxpr), set()

    def note(eqn, facts):  # facts: ROUTED, CONSTANT or None (the function's inputs and the rest)
        known = [f if isinstance(v, jcore.Var) else _CONSTANT for v, f in zip(eqn.invars, facts)]
        if all(f == _CONSTANT for f in known):  # iota, broadcast literals: nothing from the inputs
            return [_CONSTANT] * len(eqn.outvars)
        if _is_dot(eqn):
            routes = any(o is not None and o.weight.routes
                         for o in (weight_origins.of(origins, v) for v in eqn.invars))
            return [_ROUTED] * len(eqn.outvars) if routes else []
        if all(f is not None for f in known) and _ROUTED in known and eqn.outvars:
            out.add(position[eqn.outvars[0]])
            return [_ROUTED] * len(eqn.outvars)
        return []

    follow(jaxpr, [None] * len(jaxpr.invars), note)
    return out


_ROUTED, _CONSTANT = "routed", "constant"


def _routing_pinned(x, plan):
    """``x`` pinned whole over the model shards: every axis but a leading one that can be the
    batch's (its size a multiple of the data shards, with more than one), left to XLA."""
    ndim = getattr(x, "ndim", 0)
    if ndim == 0:
        return x
    batch = 1 if plan.data_shards > 1 and x.shape[0] % plan.data_shards == 0 else 0
    return _replicated(x, tuple(range(batch, ndim)), plan.mesh)


def _hidden_split_tables(jaxpr, plan, origins):
    """Pins for tables the plan splits along the axis a lookup keeps whole (the hidden axis:
    dataflow/gathers.py splits it when the vocabulary does not divide the shards). Left to XLA, that
    split spreads into the residual stream, from the looked-up rows forward and from a tied LM
    head (the stream times the table, contracted over hidden) backward, and every layer pays
    for it (measured: GPT-2 with a 127-token vocabulary, OPT with its 2050-row position table:
    1.56x Megatron's bytes per layer on 4 shards). Returns ``(lookups, reads)``:
    {index of a gather by data-dependent indices: output axes to gather whole right away} and
    {index of a matmul contracting such a table's split axis: (side of the other operand, its
    contracted axes to keep whole, so that each shard slices it locally)}."""
    if plan.mesh is None or not plan.knows_placements:
        return {}, {}
    tables = {}  # a split table, or a cast or transpose of it -> its split axis
    lookups, reads = {}, {}
    position = producers(jaxpr)

    def note(eqn, data):  # data: whether each operand depends on the function's inputs
        name = eqn.primitive.name
        if name == "gather" and data[1]:
            table = eqn.invars[0]
            dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
            shape = tuple(table.aval.shape)
            collapsed = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
            kept = [a for a in range(len(shape)) if a not in collapsed]  # -> dn.offset_dims
            whole = [(a, o) for a, o in zip(kept, dn.offset_dims)
                     if sizes[a] == shape[a] and a not in dn.start_index_map
                     and _split_along(plan, origins, table, [a])]
            if whole:
                lookups[position[eqn.outvars[0]]] = tuple(o for _, o in whole)
                tables[table] = whole[0][0]
        elif name in ("convert_element_type", "copy") and eqn.invars[0] in tables:
            tables[eqn.outvars[0]] = tables[eqn.invars[0]]
        elif name == "transpose" and eqn.invars[0] in tables:
            tables[eqn.outvars[0]] = list(eqn.params["permutation"]).index(tables[eqn.invars[0]])
        elif name == "dot_general":
            (lc, rc), _ = eqn.params["dimension_numbers"]
            for side, contract in ((0, lc), (1, rc)):
                v = eqn.invars[side]
                if isinstance(v, jcore.Var) and v in tables and tables[v] in contract:
                    reads[position[eqn.outvars[0]]] = (1 - side, tuple(rc if side == 0 else lc))
        return [True] * len(eqn.outvars) if any(data) else []

    # values that depend on the function's inputs (not constants): its inputs and what they make
    follow(jaxpr, [True] * len(jaxpr.invars), note)
    return lookups, reads


def _split_output_axes(jaxpr, v, producer, plan, origins):
    """Axes of ``v`` that are a split weight's batch or free axis carried through its matmul
    (possibly transposed once)."""
    if not isinstance(v, jcore.Var) or v not in producer:
        return set()
    eqn, perm = jaxpr.eqns[producer[v]], None
    if eqn.primitive.name == "transpose" and eqn.invars[0] in producer:
        perm = eqn.params["permutation"]
        eqn = jaxpr.eqns[producer[eqn.invars[0]]]
    if eqn.primitive.name != "dot_general":
        return set()
    operands = eqn.invars
    axes = {o for (side, d), o in output_axes(eqn).items()
            if isinstance(operands[side], jcore.Var) and _split_along(plan, origins, operands[side], [d])}
    return {perm.index(o) for o in axes} if perm is not None else axes


def _eval_fused(jaxpr, consts, args, plan, arg_origins):
    """Evaluate ``jaxpr`` with jit calls inlined and sibling matmuls fused (demand-driven, so
    that every stacked operand is computed before the one matmul that uses them all), under
    ``plan``; ``arg_origins``: the parameter each of ``args`` carries, or None (weight_origins)."""
    jaxpr = _inline(jaxpr, consts)  # same invars, in the same order
    origins = weight_origins.propagate(jaxpr, arg_origins)
    if plan.blocks > 1 and plan.knows_placements:
        jaxpr, made = _hoist_kv_repeats(jaxpr, plan, origins)
        origins = weight_origins.propagate(jaxpr, arg_origins)
        origins.update(made)
    env = dict(jaxpr.const_env)
    env.update(zip(jaxpr.invars, args))
    blocks = plan.blocks
    groups = _groups(jaxpr, plan, origins)
    chains = _partial_chains(jaxpr, groups, plan, origins)
    gates = _gate_operands(jaxpr, plan, origins)
    routing = _routing(jaxpr, plan, origins)
    lookups, table_reads = _hidden_split_tables(jaxpr, plan, origins)
    # the matmul (and transpose) a chain replaces: computed inside the chain, never on their own
    inside_chains = {j for _, i, t, _ in chains.values() for j in (i, t) if j is not None}

    def run(i, eqn, read):
        if i in inside_chains:
            return {}
        if i in groups:
            members, side, how = groups[i]
            if how == "stack":
                return run_group(members, side, read)
            return run_concat_group(members, side, how, read)
        if i in chains:
            return run_chain(i, *chains[i], read)
        vals = [read(v) for v in eqn.invars]
        for pins in (gates, table_reads):
            if i in pins:
                side, axes = pins[i]
                vals[side] = _replicated(vals[side], axes, plan.mesh)
        outs = _bind(eqn, vals, plan, [weight_origins.of(origins, v) for v in eqn.invars])
        if i in lookups:
            outs = [_replicated(outs[0], lookups[i], plan.mesh)]
        if i in routing:
            outs = [_routing_pinned(o, plan) for o in outs]
        return dict(zip(eqn.outvars, outs))

    def run_group(members, side, read):
        first = jaxpr.eqns[members[0]]
        shared = read(first.invars[side])
        others = [read(jaxpr.eqns[m].invars[1 - side]) for m in members]
        stacked = jax.numpy.stack(others, 0)  # a new leading free axis of the other operand
        y = _bind_fused_dot(first, side, shared, stacked, lambda d: d + 1)
        pos = _free_output_start(first, side, shared.ndim)
        return {jaxpr.eqns[m].outvars[0]: jax.lax.index_in_dim(y, k, pos, keepdims=False)
                for k, m in enumerate(members)}

    def run_concat_group(members, side, free, read):
        # Each weight (free axis of size s_i) is viewed as (blocks, s_i / blocks) and the views
        # are concatenated on the inner axis: with the free axis split over 'blocks' model
        # shards, every device's block of the fused weight is its own blocks of the separate ones.
        first = jaxpr.eqns[members[0]]
        shared = read(first.invars[side])
        others = [read(jaxpr.eqns[m].invars[1 - side]) for m in members]
        sizes = [o.shape[free] // blocks for o in others]
        blocked = [o.reshape(o.shape[:free] + (blocks, sz) + o.shape[free + 1:])
                   for o, sz in zip(others, sizes)]
        fused_w = jax.numpy.concatenate(blocked, axis=free + 1)
        y = _bind_fused_dot(first, side, shared, fused_w, lambda d: d + 1 if d > free else d)
        # the output's free axes of the other operand keep their order: find the blocks axis
        pos = _free_output_start(first, side, shared.ndim) + _free_axes(first, side).index(free)
        made, offset = {}, 0
        for m, sz in zip(members, sizes):
            part = jax.lax.slice_in_dim(y, offset, offset + sz, axis=pos + 1)
            made[jaxpr.eqns[m].outvars[0]] = part.reshape(
                part.shape[:pos] + (blocks * sz,) + part.shape[pos + 2:])
            offset += sz
        return made

    def run_chain(k, side2, i, t, wside, read):
        gate_spec, dot_spec, a, other, w = _reassociation(jaxpr, k, side2, i, t, wside)
        first, second = jaxpr.eqns[i], jaxpr.eqns[k]
        g = read(other)
        x = jax.numpy.einsum(gate_spec, read(a), _replicated(g, gates[k][1], plan.mesh) if k in gates else g)
        y = jax.numpy.einsum(dot_spec, x, read(w), precision=first.params.get("precision"),
                             preferred_element_type=second.outvars[0].aval.dtype)
        return {second.outvars[0]: y.astype(second.outvars[0].aval.dtype)}

    return evaluate_on_demand(jaxpr, env, run)


def _hoist_kv_repeats(jaxpr, plan, origins):
    """``(jaxpr, origins of the weights it made)``: ``jaxpr`` (flat, bound) with grouped-query
    K/V repeats moved in front of their replicated projections (kv_repeat.py), retraced, and
    {variable of each repeated weight: its origin}. A repeated weight holds each K/V head as
    often as the shards need (kv_repeat.weight_copies) and is split over them by heads like Q
    (each shard computes its own K/V heads from the whole K/V weight), so it joins Q's fused
    matmul. Unchanged (and no origins) when there is nothing to hoist."""
    is_split = lambda v, axes: _split_along(plan, origins, v, axes)  # noqa: E731
    found = {v: r for v, r in kv_repeat.find_repeats(jaxpr, is_split, plan.blocks)
             if _hoisting_pays(r, plan, origins)}
    if not found:
        return jaxpr, {}
    skip = {id(e) for r in found.values() for e in r["absorbed"]}
    repeats = list(found.items())

    def run(*args):
        weights = {}

        def hoisted(i, eqn, read):
            if eqn.outvars and eqn.outvars[0] in found:
                value, weights[eqn.outvars[0]] = kv_repeat.replay(found[eqn.outvars[0]], read,
                                                                  _bind_with)
                return {eqn.outvars[0]: value}
            if id(eqn) in skip:
                return {}
            return dict(zip(eqn.outvars, _bind(eqn, [read(v) for v in eqn.invars])))

        env = dict(jaxpr.const_env)
        env.update(zip(jaxpr.invars, args))
        outs = evaluate_on_demand(jaxpr, env, hoisted)
        # the repeated weights are returned too, to find their variables in the retraced jaxpr
        return outs + [weights[v] for v, _ in repeats]

    closed = jax.make_jaxpr(run)(*[v.aval for v in jaxpr.invars])
    n_out = len(jaxpr.outvars)
    made = {}
    for (_, r), w in zip(repeats, closed.jaxpr.outvars[n_out:]):
        source = weight_origins.of(origins, r["dot"].invars[r["weight_side"]])
        path = source.weight.path if source is not None else ("(a K/V weight)",)
        split = WeightSplit(path + ("repeated for the model shards",), tuple(w.aval.shape),
                            ((r["weight_axis"], None),))
        made[w] = weight_origins.Origin(split, tuple(range(w.aval.ndim)))
    flat = closed.jaxpr.replace(outvars=closed.jaxpr.outvars[:n_out])
    return _Bound(flat, dict(zip(flat.constvars, closed.consts))), made


def _replicated(x, axes, mesh):
    """``x`` pinned whole along ``axes`` on ``mesh``; its other axes (the batch) left to XLA."""
    P = jax.sharding.PartitionSpec
    spec = P(*[None if d in axes else P.UNCONSTRAINED for d in range(x.ndim)])
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def _hoisting_pays(repeat, plan, origins):
    """Whether summing the K/V weight gradient over the shards moves fewer bytes than summing
    K/V's activation gradient: tokens per device against the weight's input features (measured
    on benchmarks/comms.py's gqa and mqa: the better choice in each of the six cases). Always
    for a weight split over groups of shards: as written, XLA sums K/V's gradient repeated per
    query head within the group (measured: gqa on 4 shards, 16 tokens per device, 1.375x vs
    1.083x hoisted). ``repeat``: from kv_repeat.find_repeats; the data-parallel size is the
    plan's."""
    dot, side = repeat["dot"], repeat["weight_side"]
    (lc, rc), _ = dot.params["dimension_numbers"]
    x, w = dot.invars[1 - side], dot.invars[side]
    if _split_by_groups(origins, w, repeat["weight_axis"]):
        return True
    x_contract, w_contract = (rc, lc) if side == 0 else (lc, rc)
    tokens = np.prod(x.aval.shape) / np.prod([x.aval.shape[d] for d in x_contract])
    rows = np.prod([w.aval.shape[d] for d in w_contract])
    return tokens / max(1, plan.data_shards) >= rows  # the traced batch is global


def _bind_with(eqn, vals, params):
    """``eqn``'s primitive (no sub-programs) bound to ``vals`` with ``params``: a list of outputs."""
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*vals, **params)
    return outs if eqn.primitive.multiple_results else [outs]


def _bind_fused_dot(eqn, side, shared, other, renumber):
    """``eqn``'s dot_general with its non-shared operand replaced by ``other``, whose axes are
    the old ones renumbered by ``renumber`` plus one new free axis."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    shift = lambda dims: tuple(renumber(d) for d in dims)  # noqa: E731
    if side == 0:  # shared is lhs
        dn, operands = ((tuple(lc), shift(rc)), (tuple(lb), shift(rb))), (shared, other)
    else:
        dn, operands = ((shift(lc), tuple(rc)), (shift(lb), tuple(rb))), (other, shared)
    params = dict(eqn.params, dimension_numbers=dn)
    if params.get("out_sharding") is not None:
        params["out_sharding"] = None
    return eqn.primitive.bind(*operands, **params)


def _free_output_start(eqn, side, shared_ndim):
    """Where the non-shared operand's free axes begin in the dot's output (batch axes first,
    then the lhs free axes, then the rhs free axes)."""
    (lc, _), (lb, _) = eqn.params["dimension_numbers"]
    return len(lb) + (shared_ndim - len(lc) - len(lb)) if side == 0 else len(lb)


def _bind(eqn, vals, plan=None, in_origins=None):
    """Run ``eqn`` on ``vals``; given the ``plan`` (and the origins of the operands,
    weight_origins.py), the bodies of remat and scan equations are run through the rewrites too
    (only the final pass does: inlining and the K/V retrace keep them as they are, so each body
    is rewritten once)."""
    name = eqn.primitive.name
    params = dict(eqn.params)
    if plan is not None and name in ("checkpoint", "remat", "remat2") \
            and isinstance(params.get("jaxpr"), jcore.Jaxpr) and not params["jaxpr"].constvars:
        # a rematerialised body (jax.checkpoint, nnx.remat): fused inside, still rematerialised
        body = params["jaxpr"]
        run = jax.checkpoint(lambda *a: _eval_fused(body, (), a, plan, in_origins),
                             prevent_cse=params["prevent_cse"], policy=params["policy"])
        with eqn.ctx.manager:
            return list(run(*vals))
    if plan is not None and name == "scan":  # a stacked weight's body input: one layer's slice
        params["jaxpr"] = _fused_closed(params["jaxpr"], plan, weight_origins.scan_body(eqn, in_origins))
    return bind(eqn, vals, params)


def _fused_closed(closed, plan, in_origins):
    """The same ClosedJaxpr with sibling matmuls fused (for scan bodies: stacked layers)."""
    avals = [v.aval for v in closed.jaxpr.invars]
    fn = lambda *a: _eval_fused(closed.jaxpr, closed.consts, a, plan, in_origins)  # noqa: E731
    return jax.make_jaxpr(fn)(*avals)


def _inline(jaxpr, consts):
    """``jaxpr`` with its constants bound and jit sub-calls inlined, as a new flat Jaxpr."""
    def flat(*args):
        return _eval_inline(jaxpr, consts, args)
    closed = jax.make_jaxpr(flat)(*[v.aval for v in jaxpr.invars])
    return _Bound(closed.jaxpr, dict(zip(closed.jaxpr.constvars, closed.consts)))


class _Bound:
    """A jaxpr whose constvars are already bound to values (read like invars)."""
    def __init__(self, jaxpr, const_env):
        self.jaxpr, self.const_env = jaxpr, const_env
        self.invars, self.outvars, self.eqns = jaxpr.invars, jaxpr.outvars, jaxpr.eqns


def _eval_inline(jaxpr, consts, args):
    def inlined(eqn, vals):
        if eqn.primitive.name in CALLS:
            return rerun_inside(eqn, vals, _eval_inline)
        return _bind(eqn, vals)
    return evaluate(jaxpr, args, inlined, consts=consts)


def fuse_sibling_matmuls(fn, plan=RewritePlan()):
    """``fn`` with matmuls that share an input run as one matmul over stacked weights.

    Under a tensor-parallel plan, Q, K and V (or gate and up) computed as separate matmuls of the
    same input make XLA all-reduce each partial input gradient separately in the backward pass;
    stacked, the input gradient is summed locally and all-reduced once, as Megatron-LM does. The
    result is the same function (up to floating-point summation order); weights stay separate.

    ``plan`` (a :class:`~redcoast.sharding.rewrite_plan.RewritePlan`) says how ``fn``'s first
    argument, the parameters, is placed. With ``plan.blocks`` > 1 model shards, weights of
    different output widths (grouped-query Q beside K/V) are fused too, concatenated block by
    block so that a split of each weight's output axis over that many shards stays a local slice
    of the fused one. With the placements known, only matmuls whose weight the plan splits along
    an output axis are fused (a weight is recognised by the parameter it carries, not its shape)
    and the other rewrites run; with them unknown (``RewritePlan(blocks=n)``), every group is
    fused and nothing else. With ``plan.mesh``, the gates of split MoE experts and hidden-split
    lookup tables are pinned whole on it.
    """
    def fused(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat_args = jax.tree_util.tree_leaves(args)
        origins = [None] * len(flat_args)
        if plan.knows_placements:  # the parameters are the first leaves
            params = leaves_with_paths(args[0])
            origins[:len(params)] = weight_origins.of_weights(plan.leaf_splits(params))
        outs = _eval_fused(closed.jaxpr, closed.consts, flat_args, plan, origins)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
    return fused
