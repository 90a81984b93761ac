"""Small facts about traced programs shared by the data-flow analysis and the rewrites."""

import jax
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


def scan_operand_groups(eqn):
    """``(n_consts, n_carry, n_xs)``: how a ``scan`` equation's operands split into loop
    constants, carried values and scanned inputs.

    Where JAX keeps this changed: jax <= 0.10 names ``num_consts`` / ``num_carry``; jax 0.11 on
    keeps the three groups as one flat tree, ``ft_in``. Anything else fails loudly (a JAX
    redcoast does not know yet) rather than letting the analysis guess.
    """
    params, n = eqn.params, len(eqn.invars)
    if "num_consts" in params and "num_carry" in params:
        groups = (params["num_consts"], params["num_carry"],
                  n - params["num_consts"] - params["num_carry"])
    elif "ft_in" in params and hasattr(params["ft_in"], "unpack"):
        groups = tuple(len(group) for group in params["ft_in"].unpack())
    else:
        groups = None
    if groups is None or len(groups) != 3 or sum(groups) != n or min(groups) < 0:
        raise NotImplementedError(
            f"this JAX ({jax.__version__}) describes a scan's operands with parameters "
            f"{sorted(params)}, which redcoast cannot read; redcoast needs an update for it "
            "(sharding/jaxpr_tools.scan_operand_groups).")
    return groups


def bind(eqn, vals, params=None):
    """Run ``eqn`` (with its own ``params``, or these) on ``vals``, as ``jax.core.eval_jaxpr``
    does: a list of outputs."""
    bind_params = eqn.primitive.get_bind_params(dict(eqn.params) if params is None else params)
    if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
        subfuns, bind_params = bind_params
        vals = [*subfuns, *vals]
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*vals, **bind_params)
    return outs if eqn.primitive.multiple_results else [outs]
