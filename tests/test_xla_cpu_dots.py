"""benchmarks/xla_cpu_dots.py reads which dots XLA:CPU runs in Eigen's 16-bit GEMM from a compiled
program's text: the FLOPs it counts against the shapes' own, on the jax this runs. It reads XLA's
output, so a change in XLA:CPU's dot lowering or in its HLO text fails here first (a bf16
Llama's slow share, with and without redcoast's CPU options: tests/test_compiler_options.py)."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from xla_cpu_dots import slow_dot_flops  # noqa: E402

M, K, N = 64, 48, 32


def _compiled_text(fn, dtype, *shapes):
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    return jax.jit(fn).lower(*args).compile().as_text()


def _two_dots(x, w, g):
    # x @ w (the left operand contracts its trailing dim: YNNPACK's) and x^T @ g (a weight
    # gradient's form: the left operand contracts its leading dim, which XLA:CPU gives Eigen)
    return x @ w, jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())))


def test_float32_dots_outside_ynnpack_are_not_slow():
    text = _compiled_text(_two_dots, jnp.float32, (M, K), (K, N), (M, N))
    assert "__ynn_fusion" in text  # the untransposed one: YNNPACK's since jax 0.10
    assert slow_dot_flops(text) == (0, 2 * M * K * N + 2 * K * N * M)


def test_a_dot_in_a_loop_counts_once_per_iteration():
    def loop(x, w):
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x)
    assert slow_dot_flops(_compiled_text(loop, jnp.float32, (M, K), (K, K))) == (
        0, 3 * 2 * M * K * K)


def test_text_that_is_not_a_compiled_module_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        slow_dot_flops("HloModule nothing\n")
