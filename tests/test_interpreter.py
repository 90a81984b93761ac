"""The jaxpr interpreter against JAX's own programs: what it must recognise on this jax (a call,
a remat, a scan's operands) fails here first when a JAX release renames it."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from redcoast.sharding.interpreter import (CALLS, REMATS, bind, called, evaluate, follow, opened,
                                           rerun_inside, retraced, scan_operand_groups,
                                           sub_programs, total)


def _layer(w, x):
    return jnp.tanh(x @ w)


def _program(x, w, ws):
    y = jax.jit(_layer)(w, x)                       # a call
    y = jax.checkpoint(_layer)(w, y)                # a remat
    y, _ = jax.lax.scan(lambda h, wi: (_layer(wi, h), None), y, ws)  # a loop over stacked weights
    return jnp.sum(y)


ARGS = (np.ones((2, 4), np.float32), np.full((4, 4), 0.1, np.float32),
        np.full((3, 4, 4), 0.2, np.float32))


def _names(program):
    return [e.primitive.name for e in opened(program)[0].eqns]


def test_this_jax_names_its_calls_and_remats_as_the_interpreter_knows_them():
    closed = jax.make_jaxpr(_program)(*ARGS)
    names = _names(closed)
    assert CALLS & set(names), f"no call primitive of {sorted(CALLS)} among {names}"
    assert REMATS & set(names), f"no remat primitive of {sorted(REMATS)} among {names}"
    for eqn in opened(closed)[0].eqns:
        if eqn.primitive.name in CALLS | REMATS:
            assert isinstance(opened(called(eqn))[0], jcore.Jaxpr)
        if eqn.primitive.name == "scan":
            assert scan_operand_groups(eqn) == (0, 1, 1)  # no constant, h carried, ws scanned


def test_evaluating_with_no_rule_computes_the_function():
    closed = jax.make_jaxpr(_program)(*ARGS)
    (out,) = evaluate(closed, ARGS)
    np.testing.assert_array_equal(out, _program(*ARGS))


def test_a_rule_rewrites_equations_and_a_remat_stays_one():
    """A rule that doubles every tanh's input, entering calls and remats: the result is the
    function written with 2x inside, and the rewritten program still rematerialises."""
    def doubled(eqn, vals):
        if eqn.primitive.name == "tanh":
            return [jnp.tanh(2 * vals[0])]
        if eqn.primitive.name in CALLS | REMATS:
            return rerun_inside(eqn, vals, lambda j, c, a: evaluate(j, a, doubled, consts=c))
        if eqn.primitive.name == "scan":  # the body replaced by its rewritten retrace
            body = retraced(eqn.params["jaxpr"], lambda j, c, a: evaluate(j, a, doubled, consts=c))
            return bind(eqn, vals, dict(eqn.params, jaxpr=body))
        return None

    closed = jax.make_jaxpr(_program)(*ARGS)
    rewritten = jax.make_jaxpr(lambda *a: evaluate(closed, a, doubled))(*ARGS)
    assert REMATS & set(_names(rewritten))

    def expected(x, w, ws):
        y = jnp.tanh(2 * (jnp.tanh(2 * (x @ w)) @ w))
        for wi in ws:
            y = jnp.tanh(2 * (y @ wi))
        return jnp.sum(y)

    np.testing.assert_allclose(jax.core.eval_jaxpr(rewritten.jaxpr, rewritten.consts, *ARGS)[0],
                               expected(*ARGS), rtol=1e-6)


def test_total_counts_through_calls_remats_and_loops():
    """Matmuls counted: one in the call, one in the remat, three in the scan (its length)."""
    def count(eqn, total_of):
        if eqn.primitive.name == "dot_general":
            return 1
        if eqn.primitive.name == "scan":
            return eqn.params["length"] * total_of(eqn.params["jaxpr"])
        return sum(total_of(sub) for _, _, sub in sub_programs(eqn))

    assert total(jax.make_jaxpr(_program)(*ARGS), count) == 5


def test_follow_carries_facts_forward_and_drops_the_unknown():
    closed = jax.make_jaxpr(lambda x, y: jnp.tanh(x) + y * 2)(np.ones(3), np.ones(3))
    jaxpr = opened(closed)[0]

    def derived(eqn, facts):  # a fact: how many operations from x
        known = [f for f in facts if f is not None]
        return [max(known) + 1] if known else []

    env = follow(closed, [0, None], derived)
    assert env[jaxpr.outvars[0]] == 2  # tanh, then add
    assert jaxpr.invars[1] not in env
