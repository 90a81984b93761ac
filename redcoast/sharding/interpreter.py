"""The one place that walks a traced program (a jaxpr): evaluated on values, or followed with
facts about its variables, equation by equation, a rule per equation deciding what to do.

The rewrites (fusion, grouped convolutions, scanned and rematerialised weights), the FLOP count
and the weight origins are rules over :func:`evaluate`, :func:`follow` and :func:`total`; what
JAX changes between versions (the names of call and remat primitives, where a call keeps its
program, a scan's operand groups, binding an equation again) is read here, once.
"""

import jax
from jax.extend import core as jcore

# equations that call a program of their own, inline: their outputs are its outputs
CALLS = frozenset(("jit", "pjit", "closed_call", "core_call"))
# rematerialised bodies (jax.checkpoint): a call whose forward runs again in the backward pass
REMATS = frozenset(("checkpoint", "remat", "remat2"))
# bodies computed per device, never partitioned: the user's own shard_map
PER_DEVICE = frozenset(("shard_map", "xla_pmap"))


def opened(program):
    """``(jaxpr, consts)`` of a Jaxpr or ClosedJaxpr."""
    if isinstance(program, jcore.ClosedJaxpr):
        return program.jaxpr, program.consts
    return program, ()


def is_program(value):
    return isinstance(value, (jcore.Jaxpr, jcore.ClosedJaxpr))


def sub_programs(eqn):
    """``[(param name, index or None, Jaxpr or ClosedJaxpr)]``: the programs ``eqn`` holds (a
    call's, a loop's body and condition, a cond's branches; a custom rule's callables are not)."""
    out = []
    for name, value in eqn.params.items():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for i, item in enumerate(items):
            if is_program(item):
                out.append((name, i if isinstance(value, (tuple, list)) else None, item))
    return out


def called(eqn):
    """The program a call or remat equation runs (its ``jaxpr`` or ``call_jaxpr``)."""
    return eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]


def evaluate(program, args, rule=None, consts=None):
    """The outputs of ``program`` (a Jaxpr or ClosedJaxpr; ``consts`` for a Jaxpr's constvars)
    run on ``args``, equation by equation: ``rule(eqn, values)`` returns an equation's outputs,
    or None to run the equation as it is. Under a trace, the rules' outputs are a new program."""
    jaxpr, own = opened(program)
    env = dict(zip(jaxpr.constvars, own if consts is None else consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        outs = rule(eqn, vals) if rule is not None else None
        env.update(zip(eqn.outvars, bind(eqn, vals) if outs is None else outs))
    return [read(v) for v in jaxpr.outvars]


def evaluate_on_demand(program, env, run_equation):
    """The outputs of ``program`` (its variables' values so far in ``env``: inputs, constants)
    with every equation run once, in order, except that one whose outputs are read before its
    turn runs then: ``run_equation(position, eqn, read)`` returns ``{variable: value}`` for what
    it computed (its outputs, none, or several equations' at once, which then count as run);
    ``read(v)`` is any variable's value. For rewrites that run several equations as one (sibling
    matmuls fused: each operand computed before the one matmul that uses them all)."""
    jaxpr = opened(program)[0]
    made_by, env, ran = producers(jaxpr), dict(env), set()

    def read(v):
        if isinstance(v, jcore.Literal):
            return v.val
        if v not in env:
            run(made_by[v])
        return env[v]

    def run(i):
        if i in ran:
            return
        ran.add(i)
        made = run_equation(i, jaxpr.eqns[i], read)
        env.update(made)
        ran.update(made_by[v] for v in made if v in made_by)

    for i in range(len(jaxpr.eqns)):
        run(i)
    return [read(v) for v in jaxpr.outvars]


def where(program, test):
    """``[(position, eqn)]``: the equations of ``program`` that pass ``test``, in program order
    (a flat query: the programs they hold are not entered)."""
    return [(i, eqn) for i, eqn in enumerate(opened(program)[0].eqns) if test(eqn)]


def follow(program, facts_in, rule):
    """``{variable: fact}``: facts about ``program``'s variables, from those of its inputs
    (``facts_in``, None where nothing is known) forward: ``rule(eqn, facts)`` gives the facts
    of an equation's outputs from its operands' (a literal's is None), a list that may be
    shorter than the outputs (the rest unknown). Facts that are None are not kept."""
    jaxpr, _ = opened(program)
    env = {v: f for v, f in zip(jaxpr.invars, facts_in) if f is not None}
    for eqn in jaxpr.eqns:
        facts = [env.get(v) if isinstance(v, jcore.Var) else None for v in eqn.invars]
        for v, f in zip(eqn.outvars, rule(eqn, facts)):
            if f is not None:
                env[v] = f
    return env


def total(program, cost, start=0):
    """The sum (from ``start``: 0, or [] to collect) over ``program``'s equations of
    ``cost(eqn, total_of)``, where ``total_of(p)`` is this same sum for a program ``p`` the
    equation holds (how a rule counts a sub-program: once, times a loop's length, the costliest
    branch)."""
    jaxpr, _ = opened(program)
    return sum((cost(eqn, lambda p: total(p, cost, start)) for eqn in jaxpr.eqns), start)


def rerun_inside(eqn, vals, run_body, in_context=False):
    """A call or remat equation run on ``vals`` by ``run_body(jaxpr, consts, vals)`` on its
    body; a remat body stays one (``jax.checkpoint`` with the equation's own policy), run in
    the equation's context, as a call is with ``in_context``."""
    jaxpr, consts = opened(called(eqn))
    run = lambda *a: run_body(jaxpr, consts, a)  # noqa: E731
    if eqn.primitive.name in REMATS:
        run = jax.checkpoint(run, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])
        in_context = True
    if not in_context:
        return list(run(*vals))
    with eqn.ctx.manager:
        return list(run(*vals))


def retraced(program, run_body):
    """A new ClosedJaxpr of ``run_body(jaxpr, consts, args)`` over ``program``'s input types:
    the program rewritten by a rule (a loop body or a branch, replaced in its equation)."""
    jaxpr, consts = opened(program)
    return jax.make_jaxpr(lambda *a: run_body(jaxpr, consts, a))(*[v.aval for v in jaxpr.invars])


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


def producers(jaxpr):
    """{variable: position of the equation of ``jaxpr`` that makes it}."""
    return {v: i for i, e in enumerate(opened(jaxpr)[0].eqns) for v in e.outvars}


def makers(jaxpr):
    """{variable: the equation of ``jaxpr`` that makes it}."""
    return {v: e for e in opened(jaxpr)[0].eqns for v in e.outvars}


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
            "(sharding/interpreter.scan_operand_groups).")
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
