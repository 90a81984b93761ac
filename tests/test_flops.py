"""Model FLOPs counted in the trace (redcoast/layout/flops.py), against independent counts: XLA:CPU's
cost analysis of the same program, PaLM's formula for a transformer's training step, and the
same program unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from redcoast import Deployer, Trainer
from redcoast.layout.flops import traced_flops
from redcoast.models import Model
from redcoast.models.llama import LlamaConfig, LlamaForCausalLM
from redcoast.layout.throughput import compiled_flops


def xla_flops(fn, *args):
    return compiled_flops(jax.jit(fn).lower(*args).compile())


def test_matrix_products_and_their_gradients_count_as_xla_counts_them():
    a, b = jnp.ones((3, 64, 96)), jnp.ones((3, 96, 80))  # a batch dimension, then m, k, n
    assert traced_flops(jnp.matmul, a, b) == 2 * 3 * 64 * 96 * 80 == xla_flops(jnp.matmul, a, b)
    grads = jax.grad(lambda a, b: jnp.matmul(a, b).sum(), argnums=(0, 1))
    assert traced_flops(grads, a, b) == 3 * 2 * 3 * 64 * 96 * 80  # the forward, dA and dB


@pytest.mark.parametrize("groups,padding,strides,dilation", [
    (1, "VALID", (1, 1), (1, 1)), (4, "SAME", (1, 1), (1, 1)), (16, "SAME", (2, 2), (1, 1)),
    (1, ((2, 1), (0, 3)), (2, 1), (2, 1))])
def test_convolutions_and_their_gradients_count_as_xla_counts_them(groups, padding, strides,
                                                                     dilation):
    """Grouped, depthwise, strided, dilated and padded; the gradient's transposed (dX) and
    batch-grouped (dW) convolutions too: taps on padding do not count, as in XLA's count."""
    x, w = jnp.ones((2, 16, 13, 12)), jnp.ones((32, 16 // groups, 3, 3))  # NCHW, OIHW

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=dilation,
                                            feature_group_count=groups)
    assert traced_flops(conv, x, w) == xla_flops(conv, x, w) > 0
    grads = jax.grad(lambda x, w: conv(x, w).sum(), argnums=(0, 1))
    # the trace holds the forward, which XLA drops here (a sum's gradient does not need it)
    assert traced_flops(grads, x, w) == traced_flops(conv, x, w) + xla_flops(grads, x, w)
    if padding == "VALID":
        assert traced_flops(conv, x, w) == 2 * (2 * 32 * 11 * 10) * 16 * 3 * 3


def test_loops_branches_and_rematerialisation():
    a = jnp.ones((32, 32))
    one = 2 * 32 ** 3
    scanned = lambda a: jax.lax.scan(lambda c, _: (c @ a, None), a, None, length=5)[0]
    assert traced_flops(scanned, a) == 5 * one
    branches = lambda a: jax.lax.cond(a[0, 0] > 0, lambda a: a @ a @ a, lambda a: a, a)
    assert traced_flops(branches, a) == 2 * one  # the costlier branch
    recomputed = jax.grad(lambda a: jax.checkpoint(lambda a: jnp.sin(a @ a))(a).sum())
    assert traced_flops(recomputed, a) == 4 * one  # forward, recomputed forward, two in backward
    looped = lambda a: jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] @ a, c[1] + 1),
                                          (a, 0))[0]
    assert traced_flops(looped, a) == one  # the trip count is not in the program: once

    @jax.custom_vjp
    def square(a):
        return a @ a
    square.defvjp(lambda a: (a @ a, a), lambda a, g: (g @ a.T + a.T @ g,))
    assert traced_flops(square, a) == one  # the primal program


def test_a_shard_map_body_counts_on_every_device_it_runs_on():
    mesh = jax.make_mesh((2, 4), ("dp", "mp"))
    specs = (P("dp", "mp"), P("mp", None))
    a, b = (jax.device_put(jnp.ones(shape), NamedSharding(mesh, spec))
            for shape, spec in zip(((64, 96), (96, 80)), specs))
    # each of the 8 devices multiplies a (32, 24) block by a (24, 80) one: partial sums, kept
    local = jax.shard_map(jnp.matmul, mesh=mesh, in_specs=specs, out_specs=P("dp", None),
                          check_vma=False)
    assert traced_flops(local, a, b) == 2 * 64 * 96 * 80


def _llama(kv_heads):
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=kv_heads,
                         max_position_embeddings=64)
    return config, Model(LlamaForCausalLM, config)


def _loss(rng, state, params, batch, is_training):
    logits = state.apply_fn(params, batch["ids"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()


def _collate(rows):
    return {"ids": np.stack([r["ids"] for r in rows])}


@pytest.mark.parametrize("shards,accumulate,kv_heads", [(1, 1, 2), (4, 2, 4)])
def test_a_llama_training_step_is_palms_formula_exactly_on_any_layout(shards, accumulate,
                                                                       kv_heads):
    """The Trainer's logged MFU counts 6N + 12·L·s·h per token (N: the matmul parameters),
    over the mesh's devices, whatever the layout and the micro-batches. (With fewer K/V heads
    than model shards the layout projects K/V per query head, and that work counts too.)"""
    config, model = _llama(kv_heads)
    params = model.init(0)
    deployer = Deployer(jax_seed=0, n_model_shards=shards, verbose=False)
    trainer = Trainer(deployer, _collate, model.apply, _loss, params, optax.adamw(1e-3),
                      accumulate_grad_batches=accumulate)
    per_device, seq = 2, 32
    rows = deployer.global_batch_size(per_device) * accumulate
    examples = [{"ids": r} for r in np.random.default_rng(0).integers(
        0, config.vocab_size, (rows, seq + 1)).astype(np.int32)]
    trainer.train(examples, per_device, shuffle=False)
    batch = jax.tree_util.tree_map(jnp.asarray, _collate(examples))
    if accumulate > 1:
        batch = jax.tree_util.tree_map(lambda x: x.reshape(accumulate, -1, *x.shape[1:]), batch)
    cost = trainer._meter.cost(trainer._state, batch, trainer._progress.train_key)
    leaves = jax.tree_util.tree_leaves(params)
    n_matmul = (sum(x.size for x in leaves) - config.vocab_size * config.hidden_size
                - sum(x.size for x in leaves if x.ndim == 1))  # no embedding lookup, no norms
    per_token = 6 * n_matmul + 12 * config.num_hidden_layers * seq * config.hidden_size
    assert cost.flops_per_device * jax.device_count() == per_token * rows * seq
