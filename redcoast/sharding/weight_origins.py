"""Which variables of a traced program carry which parameter, and which of its axes.

The rewrites of fusion.py decide per matmul operand whether it is a weight the plan splits. A
parameter reaches its matmul as a jaxpr variable of the program's inputs, possibly cast to the
compute dtype, constrained to its sharding, transposed or reshaped (Flax's DenseGeneral), or one
layer's slice of a stacked tensor (a scan body's input, or an index into the stack). Those steps
keep it the same weight, with its axes renumbered; anything else (an arithmetic op, a gather, a
custom_jvp/custom_vjp call, a loop carry) makes a value whose placement is not the parameter's:
it has no origin, so no rewrite treats it as split.
"""

import dataclasses

import numpy as np
from jax.extend import core as jcore

from .interpreter import (CALLS, PER_DEVICE, REMATS, bind, called, evaluate, follow, rerun_inside,
                          retraced, scan_operand_groups, sub_programs)

# the same values, or a view of them: the output's axes are the input's
_SAME = frozenset(("convert_element_type", "copy", "copy_p", "sharding_constraint",
                   "reduce_precision", "optimization_barrier"))


@dataclasses.dataclass(frozen=True)
class Origin:
    """A variable that is (a view of) one parameter: ``weight`` (a rewrite_plan.WeightSplit) and,
    for each axis of the variable, the parameter's axis it is, or None."""
    weight: object
    axes: tuple

    def split_along(self, var_axes):
        """Whether the plan splits one of ``var_axes`` over every model shard."""
        return any(self.weight.groups(self.axes[d]) == (None,) for d in var_axes
                   if self.axes[d] is not None)

    def split_by_groups(self, var_axis):
        """Whether the plan splits ``var_axis`` over groups of the model shards."""
        a = self.axes[var_axis]
        groups = None if a is None else self.weight.groups(a)
        return groups is not None and groups[0] is not None

    def renumbered(self, axes):
        """This origin for a variable whose axes are this one's ``axes`` (None: a new axis)."""
        new = tuple(None if a is None else self.axes[a] for a in axes)
        return Origin(self.weight, new) if any(a is not None for a in new) else None


def of_weights(weights):
    """The origins of the parameter leaves themselves (``weights``: WeightSplits)."""
    return [Origin(w, tuple(range(len(w.shape)))) for w in weights]


def of(origins, v):
    """The origin of ``v`` (a variable or a literal) in ``origins``, or None."""
    return origins.get(v) if isinstance(v, jcore.Var) else None


def propagate(jaxpr, invar_origins):
    """{variable: Origin} for the variables of the flat ``jaxpr`` that carry a parameter, given
    the origins (or None) of its invars."""
    return follow(jaxpr, invar_origins, through)


# reading a parameter through these is not a use: they make a view of it
VIEWS = ("convert_element_type", "copy", "copy_p", "sharding_constraint", "reduce_precision")


def visit_reads(closed, weights, use):
    """Call ``use(eqn, read)`` for each equation of ``closed`` (a ClosedJaxpr whose first
    ``len(weights)`` inputs are the parameter leaves; ``weights``: their WeightSplits) that reads
    a leaf, through calls and views (not a use), with ``read``: {leaf index: (operand position,
    origin)}. Equations holding other programs (loops, remats) are uses themselves."""
    index = {w.path: i for i, w in enumerate(weights)}

    def reads(eqn, ins):
        if eqn.primitive.name in CALLS:
            follow(called(eqn), ins, reads)
        elif eqn.primitive.name not in VIEWS:
            read = {index[o.weight.path]: (k, o) for k, o in enumerate(ins) if o is not None}
            if read:
                use(eqn, read)
        return through(eqn, ins)

    rest = [None] * (len(closed.jaxpr.invars) - len(weights))
    follow(closed.jaxpr, of_weights(weights) + rest, reads)


def scan_body(eqn, ins):
    """The origins of a scan body's inputs from those of the scan's operands (``ins``): loop
    constants as they are, carried values none (they change), scanned inputs one slice of
    theirs (the leading axis dropped)."""
    n_consts, n_carry, _ = scan_operand_groups(eqn)
    out = []
    for k, o in enumerate(ins):
        if o is None or n_consts <= k < n_consts + n_carry:
            out.append(None)
        elif k < n_consts:
            out.append(o)
        else:
            out.append(o.renumbered(range(1, len(o.axes))))
    return out


def body_origins(eqn, key, ins):
    """The origins of the inputs of ``eqn``'s sub-program ``key`` (a loop or branch body) from
    those of ``eqn``'s operands: loop constants keep theirs, carried values have none."""
    name = eqn.primitive.name
    if name == "scan":
        return scan_body(eqn, ins)
    if name == "cond":  # the first operand is the branch index
        return ins[1:]
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    carry = [None] * (len(ins) - cn - bn)
    return ins[:cn] + carry if key == "cond_jaxpr" else ins[cn:cn + bn] + carry


def run_with_origins(jaxpr, consts, args, arg_origins, rule, enters, opaque=None):
    """The outputs of the flat ``jaxpr`` run on ``args``, each equation through ``rule(eqn,
    values, origins of its operands)``, which returns its outputs or None (run as traced).

    An equation holding a sub-program for which ``enters(program)`` holds is run with that
    program rewritten the same way: a call's or a remat's body in place (a remat stays one,
    with its policy), a loop's body or a branch retraced (loop constants keep their origins,
    carries have none); a ``shard_map`` is left as it is. ``opaque(eqn)``, if given, is called
    for one the rule cannot enter (a custom_vjp or custom_jvp: its derivative is the user's own
    rule), before it runs as traced.
    """
    origins = propagate(jaxpr, arg_origins)

    def run_again(j, c, a, o):
        return run_with_origins(j, c, a, o, rule, enters, opaque)

    def each(eqn, vals):
        ins = [of(origins, v) for v in eqn.invars]
        out = rule(eqn, vals, ins)
        if out is not None:
            return out
        name, subs = eqn.primitive.name, sub_programs(eqn)
        if name in PER_DEVICE or not any(enters(sub) for _, _, sub in subs):
            return None  # the user's own shard_map is computed per device, never partitioned
        if name in CALLS or (name in REMATS and isinstance(eqn.params.get("jaxpr"), jcore.Jaxpr)):
            return rerun_inside(eqn, vals, lambda j, c, a: run_again(j, c, a, ins))
        if name in ("scan", "while", "cond"):  # loop and branch bodies: ClosedJaxprs, replaced
            params = dict(eqn.params)
            for key, i, sub in subs:
                inner = body_origins(eqn, key, ins)
                new = retraced(sub, lambda j, c, a, o=inner: run_again(j, c, a, o))
                params[key] = new if i is None else tuple(
                    new if k == i else s for k, s in enumerate(params[key]))
            return bind(eqn, vals, params)
        if opaque is not None:
            opaque(eqn)
        return None

    return evaluate(jaxpr, args, each, consts=consts)


def through(eqn, ins):
    """The origins of ``eqn``'s outputs from its operands' (``ins``): a view keeps its
    parameter, with its axes renumbered; anything else makes none (an empty list)."""
    name = eqn.primitive.name
    if name in _SAME:
        return ins
    src = ins[0] if ins else None
    if src is None:
        return ()
    x, out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    if name == "transpose":
        return [src.renumbered(eqn.params["permutation"])]
    if name == "squeeze":
        dropped = {d % len(x) for d in eqn.params["dimensions"]}
        return [src.renumbered([d for d in range(len(x)) if d not in dropped])]
    if name in ("slice", "dynamic_slice"):  # the axes taken whole stay the parameter's
        return [src.renumbered([d if out[d] == x[d] else None for d in range(len(x))])]
    if name == "reshape" and eqn.params.get("dimensions") is None:
        return [src.renumbered([_same_axis(x, out, j) for j in range(len(out))])]
    return ()


def _same_axis(src, dst, j):
    """The axis of ``src`` that is axis ``j`` of ``dst`` after a row-major reshape (same size,
    same product of the sizes before it), or None."""
    before = int(np.prod(dst[:j], dtype=np.int64))
    for i in range(len(src)):
        if src[i] == dst[j] and int(np.prod(src[:i], dtype=np.int64)) == before:
            return i
    return None
