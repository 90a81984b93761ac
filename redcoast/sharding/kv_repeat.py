"""Grouped-query K/V computed per query head when the plan cannot split them.

With more model shards than KV heads, the plan splits the query heads and replicates the K/V
projections; the user's code repeats K/V to one per query head (Llama's ``repeat_kv``,
``jnp.repeat``). XLA then all-reduces the activation gradient of K and V in the backward pass:
each shard holds the gradient of the query heads it owns, summed over a group that spans shards.

This rewrite moves the repeat in front of the projection: ``repeat(f(x @ W))`` becomes
``repeat'(f'(x @ repeat(W)))``, where ``f`` is the head-wise code between them (RoPE, casts, a
reshape into heads) replayed on the repeated heads. The weight is repeated only as far as the
shards need (:func:`weight_copies`): each shard projects its own group's K/V heads once, and the
rest of the repeat (to one per query head) is local to the shard. The repeated projection is split
like Q by heads, so it is fused with Q (one input-gradient all-reduce), and what is summed over the
shards is the gradient of the small K/V weights instead. Applied only where every step of ``f``
provably treats heads alike; anything else is left as written.
"""

import math

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from .interpreter import makers, output_axes, read_once, readers, where

_ELEMENTWISE = frozenset("""
    add sub mul div neg max min exp exp2 log log1p expm1 tanh logistic sin cos sqrt rsqrt
    integer_pow pow square abs sign erf convert_element_type copy select_n clamp
    and or not eq ne lt gt le ge
""".split())


class _NotHeadwise(Exception):
    pass


def weight_copies(heads, groups, shards):
    """How many copies of each of ``heads`` K/V heads (each read by ``groups`` query heads) the
    repeated weight holds on ``shards`` model shards: the fewest whose count the shards divide
    (``lcm(heads, shards) / heads``), so that a shard projects each K/V head its query heads read
    once, not once per query head (measured: 32 query heads on 4 K/V heads over 8 shards, the
    fused Q/K/V matmul 768 -> 384 columns a shard at the 1B width); one per query head where
    that count does not divide the query heads."""
    total = math.lcm(heads, shards)
    return total // heads if (heads * groups) % total == 0 else groups


def find_repeats(jaxpr, is_split, shards=1):
    """[(repeat output var, plan)] for each K/V repeat that can be hoisted.

    ``jaxpr`` is flat (jit calls inlined); ``is_split(weight, axes)`` tells whether the plan splits
    that weight (a variable of ``jaxpr``) along one of those axes (a split K/V needs no rewrite);
    ``shards``: the model shards the repeated weight is split over (:func:`weight_copies`).
    """
    reads = readers(jaxpr)
    producer = makers(jaxpr)
    found = []
    for _, eqn in where(jaxpr, lambda e: e.primitive.name == "reshape"):
        repeat = _repeat_of(eqn, producer, reads)
        if repeat is None:
            continue
        source, axis, groups, absorbed = repeat
        try:
            plan = _trace_back(jaxpr, source, axis, groups, producer, reads, is_split)
        except _NotHeadwise:
            continue
        plan["absorbed"] = plan["absorbed"] | absorbed
        plan["copies"] = weight_copies(plan["heads"], groups, shards)
        found.append((eqn.outvars[0], plan))
    return found


def _repeat_of(eqn, producer, reads):
    """(repeated var, its head axis, group size, eqns of the repeat) when ``eqn`` is the reshape
    that ends ``broadcast_in_dim`` (a new axis after the heads) + reshape (merged into them)."""
    if eqn.primitive.name != "reshape" or eqn.params.get("dimensions") is not None:
        return None
    expanded, out_shape = eqn.invars[0], tuple(eqn.outvars[0].aval.shape)
    absorbed, v = {eqn}, expanded
    while isinstance(v, jcore.Var) and v in producer and producer[v].primitive.name == "broadcast_in_dim" \
            and read_once(v, reads):
        absorbed.add(producer[v])
        v = producer[v].invars[0]
    if not isinstance(v, jcore.Var) or v is expanded:
        return None
    src, big = tuple(v.aval.shape), tuple(expanded.aval.shape)
    for a in range(len(src)):
        g = big[a + 1] if len(big) == len(src) + 1 else None
        if g and g > 1 and big == src[:a + 1] + (g,) + src[a + 1:] \
                and out_shape == src[:a] + (src[a] * g,) + src[a + 1:]:
            return v, a, g, absorbed
    return None


def _trace_back(jaxpr, x, axis, groups, producer, reads, is_split):
    """Walk from the repeated value ``x`` back to the matmul that made it, through head-wise
    eqns. Every value on the way gets a head descriptor (axis, inner): that axis is (heads,
    inner) in row-major order. Values the walk cannot follow are inputs of the chain (read as
    they are, repeated like the heads if they have them)."""
    heads = x.aval.shape[axis]
    desc, seen, dots, stack = {x: (axis, 1)}, set(), set(), [x]
    while stack:
        v = stack.pop()
        eqn = producer.get(v)
        if eqn is None or eqn in seen:
            continue
        if eqn.primitive.name == "dot_general":
            dots.add(eqn)
            continue
        try:
            ins = _input_descriptors(eqn, *desc[v], heads)
        except _NotHeadwise:
            continue
        seen.add(eqn)
        for u, d in ins:
            if desc.setdefault(u, d) != d:
                raise _NotHeadwise("inconsistent heads")
            stack.append(u)
    # the chain: what is computed from one matmul's output on the way to x
    for dot in dots:
        chain_vars, region = {dot.outvars[0]}, []
        for _, e in where(jaxpr, lambda e: e in seen):
            if any(v in chain_vars for v in e.invars if isinstance(v, jcore.Var)):
                region.append(e)
                chain_vars.update(e.outvars)
        if x in chain_vars:
            break
    else:
        raise _NotHeadwise("no matmul")
    region_set = set(region)
    for v in chain_vars - {x}:  # nothing outside the chain (None: the output) reads its values
        if any(r not in region_set for r in reads.get(v, ())):
            raise _NotHeadwise("a value of the chain is read elsewhere")
    if not read_once(x, reads):
        raise _NotHeadwise("the repeated value is read elsewhere")
    a, inner = desc[dot.outvars[0]]
    w_side, w_axis = _weight_axis(dot, a)
    weight = dot.invars[w_side]
    if is_split(weight, [w_axis]):
        raise _NotHeadwise("the plan splits this weight")
    return {"dot": dot, "weight_side": w_side, "weight_axis": w_axis, "inner": inner,
            "heads": heads, "groups": groups, "region": region, "desc": desc, "source": x,
            "absorbed": region_set | {dot}}


def _input_descriptors(eqn, a, inner, heads):
    """[(input var in the chain, its head descriptor)]; raises when ``eqn`` is not head-wise."""
    name, out = eqn.primitive.name, eqn.outvars[0]
    if len(eqn.outvars) != 1:
        raise _NotHeadwise(name)
    ins = [v for v in eqn.invars if isinstance(v, jcore.Var)]
    if name in _ELEMENTWISE or name == "concatenate":
        if name == "concatenate" and eqn.params["dimension"] == a:
            raise _NotHeadwise("concatenated along the heads")
        # operands with the full head axis belong to the chain; size-1 (broadcast) ones do not
        return [(v, (a, inner)) for v in ins if v.aval.ndim == out.aval.ndim
                and v.aval.shape[a] == out.aval.shape[a]]
    if name == "slice":
        s, lim = eqn.params["start_indices"], eqn.params["limit_indices"]
        st = eqn.params["strides"]
        if s[a] != 0 or lim[a] != eqn.invars[0].aval.shape[a] or (st and st[a] != 1):
            raise _NotHeadwise("sliced along the heads")
        return [(eqn.invars[0], (a, inner))]
    if name == "transpose":
        return [(eqn.invars[0], (eqn.params["permutation"][a], inner))]
    if name == "broadcast_in_dim":
        dims, op = eqn.params["broadcast_dimensions"], eqn.invars[0]
        if a not in dims or op.aval.shape[dims.index(a)] != out.aval.shape[a]:
            raise _NotHeadwise("heads made by a broadcast")
        return [(op, (dims.index(a), inner))]
    if name == "reshape" and eqn.params.get("dimensions") is None:
        src, dst = eqn.invars[0].aval.shape, out.aval.shape
        prefix = int(np.prod(dst[:a], dtype=np.int64))
        for j in range(len(src)):
            if int(np.prod(src[:j], dtype=np.int64)) == prefix and src[j] % heads == 0 and src[j] >= heads:
                return [(eqn.invars[0], (j, src[j] // heads))]
        raise _NotHeadwise("a reshape that moves the heads")
    raise _NotHeadwise(name)


def _weight_axis(dot, out_axis):
    """(operand side, axis) of the matmul operand whose free axis is ``out_axis`` of the output."""
    sources = [key for key, o in output_axes(dot).items() if o == out_axis]
    if len(sources) != 1:
        raise _NotHeadwise("heads on a batch axis of the matmul")
    return sources[0]


def repeat_heads(x, axis, heads, inner, groups):
    """``x`` whose ``axis`` is (heads, inner) with every head repeated ``groups`` times."""
    shape = x.shape
    view = x.reshape(shape[:axis] + (heads, inner) + shape[axis + 1:])
    view = jnp.repeat(view, groups, axis=axis)
    return view.reshape(shape[:axis] + (heads * groups * inner,) + shape[axis + 1:])


def replay(plan, read, bind):
    """``(the repeated value, the repeated weight it is computed from)`` (``read`` gives the
    values of variables outside the chain, ``bind(eqn, values, params)`` runs one eqn). The
    chain runs on ``plan["copies"]`` copies of each head; the value is repeated the rest of the
    way to one per query head at the end."""
    heads, copies, desc = plan["heads"], plan["copies"], plan["desc"]
    dot = plan["dot"]
    ops = [read(v) if not isinstance(v, jcore.Literal) else v.val for v in dot.invars]
    side, w_axis = plan["weight_side"], plan["weight_axis"]
    ops[side] = repeat_heads(ops[side], w_axis, heads, plan["inner"], copies)
    env = {dot.outvars[0]: bind(dot, ops, _without_out_sharding(dot.params))[0]}
    for eqn in plan["region"]:
        out = eqn.outvars[0]
        a, inner = desc[out]
        vals = []
        for v in eqn.invars:
            if isinstance(v, jcore.Literal):
                vals.append(v.val)
            elif v in env:
                vals.append(env[v])
            else:
                x = read(v)
                if (eqn.primitive.name in _ELEMENTWISE or eqn.primitive.name == "concatenate") \
                        and np.ndim(x) == out.aval.ndim \
                        and x.shape[a] == out.aval.shape[a] and x.shape[a] > 1:
                    x = repeat_heads(x, a, heads, inner, copies)  # a per-head operand
                vals.append(x)
        env[out] = bind(eqn, vals, _params_for(eqn, a, heads * copies * inner))[0]
    source = plan["source"]
    value = env[source]
    if copies != plan["groups"]:  # within a shard: its copies to its query heads
        axis, inner = desc[source]
        value = repeat_heads(value, axis, heads * copies, inner, plan["groups"] // copies)
    return value, ops[side]


def _params_for(eqn, a, size):
    """``eqn``'s params for an output whose axis ``a`` now has ``size`` elements."""
    params = _without_out_sharding(eqn.params)
    name = eqn.primitive.name
    if name == "slice":
        lim = list(params["limit_indices"])
        lim[a] = size
        params["limit_indices"] = tuple(lim)
    elif name == "broadcast_in_dim":
        shape = list(params["shape"])
        shape[a] = size
        params["shape"] = tuple(shape)
    elif name == "reshape":
        sizes = list(params["new_sizes"])
        sizes[a] = size
        params["new_sizes"] = tuple(sizes)
    return params


def _without_out_sharding(params):
    params = dict(params)
    for key in ("out_sharding", "sharding"):
        if params.get(key) is not None:
            params[key] = None
    return params
