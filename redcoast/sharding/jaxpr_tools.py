"""Small facts about traced programs shared by the data-flow analysis and the rewrites."""

from jax.extend import core as jcore


def output_axes(dot):
    """{(operand side, operand axis): output axis} of a ``dot_general`` equation: batch axes
    first, then the lhs free axes, then the rhs free axes; contracted axes have none."""
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    out = {}
    for i, (l, r) in enumerate(zip(lb, rb)):
        out[(0, l)] = out[(1, r)] = i
    position = len(lb)
    for side, (contract, batch) in enumerate(((lc, lb), (rc, rb))):
        for d in range(dot.invars[side].aval.ndim):
            if d not in contract and d not in batch:
                out[(side, d)] = position
                position += 1
    return out


def readers(jaxpr):
    """{variable: the equations that read it}, with None once for each time it is an output."""
    out = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                out.setdefault(v, []).append(eqn)
    for v in jaxpr.outvars:
        if isinstance(v, jcore.Var):
            out.setdefault(v, []).append(None)
    return out


def read_once(v, reads):
    """Whether ``v`` is read by exactly one equation and is not an output (``reads``: from
    :func:`readers`)."""
    found = reads.get(v, ())
    return len(found) == 1 and found[0] is not None
