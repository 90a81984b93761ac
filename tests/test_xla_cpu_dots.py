"""benchmarks/xla_cpu_dots.py reads which dots XLA:CPU leaves to Eigen from a compiled program's
text: the FLOPs it counts against the shapes' own, on the jax this runs (it reads XLA's output, so
a change in XLA:CPU's dot lowering or its HLO text fails here first)."""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from xla_cpu_dots import dot_flops_outside_ynn  # noqa: E402

M, K, N = 64, 48, 32


def _compiled_text(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return jax.jit(fn).lower(*args).compile().as_text()


def test_a_dot_whose_left_operand_contracts_its_leading_dim_is_counted_outside_ynnpack():
    # x @ w (the left operand contracts its trailing dim: YNNPACK's) and x^T @ g (a weight
    # gradient's form: the left operand contracts its leading dim, which XLA:CPU gives Eigen)
    def two_dots(x, w, g):
        tn = jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())))
        return x @ w, tn
    text = _compiled_text(two_dots, (M, K), (K, N), (M, N))
    outside, total = dot_flops_outside_ynn(text)
    assert total == 2 * M * K * N + 2 * K * N * M
    assert "__ynn_fusion" in text  # XLA:CPU has used YNNPACK for float32 dots since jax 0.10
    assert outside == 2 * K * N * M, (outside, total)


def test_a_dot_in_a_loop_counts_once_per_iteration():
    def loop(x, w):
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x)
    outside, total = dot_flops_outside_ynn(_compiled_text(loop, (M, K), (K, K)))
    assert total == 3 * 2 * M * K * K and outside == 0, (outside, total)


def test_text_that_is_not_a_compiled_module_is_refused():
    import pytest
    with pytest.raises(ValueError, match="no ENTRY computation"):
        dot_flops_outside_ynn("HloModule nothing\n")
