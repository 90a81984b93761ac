"""benchmarks/xla_cpu_dots.py reads which dots XLA:CPU runs in Eigen's 16-bit GEMM from a compiled
program's text: the FLOPs it counts against the shapes' own, on the jax this runs. It reads XLA's
output, so a change in XLA:CPU's dot lowering or in its HLO text fails here first."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from xla_cpu_dots import slow_dot_flops  # noqa: E402

M, K, N = 64, 48, 32
NEWER_THAN_0_10 = tuple(int(x) for x in jax.__version__.split(".")[:2]) > (0, 10)


def _compiled_text(fn, dtype, *shapes):
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    return jax.jit(fn).lower(*args).compile().as_text()


def _two_dots(x, w, g):
    # x @ w (the left operand contracts its trailing dim: YNNPACK's) and x^T @ g (a weight
    # gradient's form: the left operand contracts its leading dim, which XLA:CPU gives Eigen)
    return x @ w, jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())))


def test_a_bfloat16_llama_s_weight_gradients_are_slow_where_xla_keeps_them_in_bfloat16():
    # a one-layer Llama computing in bfloat16, as B2's: jax 0.10's XLA:CPU multiplies bfloat16
    # in float32 (nothing slow); 0.12's keeps bfloat16 and lays out the weight gradients of the
    # MLP and the head so that they run in Eigen (B2 at 8x1: 29% of redcoast's dot FLOPs)
    import optax
    from redcoast.models import Model, llama
    config = llama.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176,
                               num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=64,
                               dtype=jnp.bfloat16)
    model = Model(llama.LlamaForCausalLM, config, param_dtype=jnp.float32)
    ids = jnp.zeros((2, 33), jnp.int32)

    def loss(params):
        params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
        logits = model.apply(params, ids[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    text = jax.jit(jax.value_and_grad(loss)).lower(model.init(0)).compile().as_text()
    slow, total = slow_dot_flops(text)
    tokens = ids[:, :-1].size
    assert total >= 6 * tokens * (512 + 3 * 176) * 64  # the head's and the MLP's three passes
    share = slow / total
    assert (0.2 < share < 0.5) if NEWER_THAN_0_10 else share == 0, share


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
