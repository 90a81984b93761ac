"""Throughput in the logs: tokens/s, step time, MFU from the compiled step, gradient norm."""

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from redcoast import Deployer, Trainer
from redcoast.layout.throughput import StepCost, compiled_flops, peak_flops, tokens_per_example
from tiny_lm import SEQ, collate_fn, loss_fn, make_examples, make_model


def device(kind, platform="gpu"):
    return types.SimpleNamespace(device_kind=kind, platform=platform)


@pytest.mark.parametrize("kind,dtype,tflops", [
    ("NVIDIA H100 80GB HBM3", jnp.bfloat16, 989.4),
    ("NVIDIA H100 80GB HBM3", jnp.float32, 494.7),
    ("NVIDIA H100 PCIe", jnp.bfloat16, 756.0),
    ("NVIDIA H100 NVL", jnp.float16, 835.0),
    ("NVIDIA H200", jnp.bfloat16, 989.4),
    ("NVIDIA GH200 480GB", jnp.bfloat16, 989.4),
    ("NVIDIA A100-SXM4-80GB", jnp.bfloat16, 312.0),
    ("NVIDIA L4", jnp.bfloat16, 121.0),
    ("TPU v5 lite", jnp.bfloat16, 197.0),
    ("TPU v5p", jnp.bfloat16, 459.0),
    ("TPU v4", jnp.bfloat16, 275.0),
    ("TPU v4", jnp.float32, None),
    ("cpu", jnp.float32, None),
    ("NVIDIA GeForce GTX 1080", jnp.bfloat16, None),
])
def test_peak_flops_by_device_kind(kind, dtype, tflops):
    got = peak_flops(device(kind), dtype)
    assert got == (None if tflops is None else tflops * 1e12)


def test_compiled_flops_count_one_device_share_of_a_matmul():
    m, k, n = 64, 96, 80
    a, b = jnp.ones((m, k)), jnp.ones((k, n))
    assert compiled_flops(jax.jit(jnp.matmul).lower(a, b).compile()) == 2 * m * k * n
    # rows split over the 8 devices: each device multiplies 1/8 of them
    rows = NamedSharding(jax.make_mesh((8,), ("dp",)), P("dp"))
    split = jax.jit(jnp.matmul, in_shardings=(rows, None), out_shardings=rows)
    assert compiled_flops(split.lower(a, b).compile()) == 2 * m * k * n / 8


def test_tokens_per_example_reads_the_longest_integer_sequence():
    batch = {"ids": np.zeros((4, 12), np.int32), "labels": np.zeros((4, 7), np.int64),
             "pixels": np.zeros((4, 8), np.float32), "n": np.zeros((4,), np.int32)}
    assert tokens_per_example(batch) == 12
    assert tokens_per_example({"x": np.zeros((4, 3), np.float32)}) is None


def test_rates_of_a_step_cost():
    cost = StepCost(examples=16, tokens=16 * 128, flops_per_device=2e12, peak_flops=1e15)
    rates = cost.rates(steps=10, seconds=5.0)
    assert rates == {"step_time_s": 0.5, "examples_per_s": 32.0, "tokens_per_s": 4096.0,
                     "mfu": 10 * 2e12 / 5.0 / 1e15}
    assert StepCost(16, None, 2e12, None).rates(1, 1.0)["mfu"] is None


@pytest.mark.parametrize("accumulate", [1, 2])
def test_fit_logs_throughput_mfu_and_the_gradient_norm(tmp_path, accumulate):
    model, params = make_model()
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(tmp_path), verbose=False)
    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.sgd(0.1),
                      log_grad_norm=True, accumulate_grad_batches=accumulate,
                      fsdp=False, fuse_matmuls=False)  # what is logged is the subject, not the layout
    per_update = 32 * accumulate  # 8 per data shard x 4 data shards, per micro-batch
    examples = make_examples(per_update * 4)  # 4 updates
    trainer.fit(examples, per_device_batch_size=8, n_epochs=1, shuffle=False,
                log_every_n_steps=1)
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    train = [r for r in rows if "train_loss" in r]
    assert len(train) == 4
    first, later = train[0], train[1:]
    assert "train_tokens_per_s" not in first  # the first window holds only the compiling step
    for row in later:
        assert row["train_mfu"] is None  # CPU devices: no known peak (JSON null)
        assert row["train_step_time_s"] > 0
        # tokens: the update's examples x the batch's sequence length (SEQ + 1 ids per example)
        np.testing.assert_allclose(row["train_tokens_per_s"],
                                   row["train_examples_per_s"] * (SEQ + 1), rtol=1e-9)
        np.testing.assert_allclose(row["train_examples_per_s"] * row["train_step_time_s"],
                                   per_update, rtol=1e-9)

    # the logged norm of the first update's gradient, against one computed by hand
    state = types.SimpleNamespace(apply_fn=model.apply)
    batch = collate_fn(examples[:per_update])  # equal micro-batches: the mean of their means
    grads = jax.grad(lambda p: loss_fn(jax.random.PRNGKey(0), state, p, batch, True)[0])(params)
    np.testing.assert_allclose(first["train_grad_norm"], float(jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree_util.tree_leaves(grads)))),
                               rtol=1e-5)


def test_throughput_logging_pulls_nothing_beyond_the_metrics(monkeypatch):
    import redcoast.loop.step_meter as step_meter_module
    import redcoast.trainer as trainer_module

    pulls = []
    real = trainer_module.to_host
    for module in (trainer_module, step_meter_module):  # the loop's, and its logging window's
        monkeypatch.setattr(module, "to_host", lambda tree: pulls.append(1) or real(tree))
    model, params = make_model()
    trainer = Trainer(Deployer(jax_seed=0, n_model_shards=2, verbose=False), collate_fn,
                      model.apply, loss_fn, params, optax.sgd(0.1))
    trainer.train(make_examples(4 * 2 * 8), per_device_batch_size=2, shuffle=False,
                  log_every_n_steps=4)
    assert len(pulls) == 2  # one per logging window of 4 updates: the metrics' own


def test_step_cost_and_compile_train_step_take_one_updates_micro_batches():
    """With accumulate_grad_batches=2, one update's batch stacks 2 micro-batches on a new first
    axis (as the docstrings say); both calls indexed that abstract batch and raised TypeError
    (they read it through the same Trainer._settled_micro_batch: step_cost, which compiles
    nothing, stands for both). The update's matrix-product FLOPs are twice one micro-batch's,
    counted independently by a trainer that does not accumulate."""
    from redcoast.errors import ConfigError
    model, params = make_model()
    micro = collate_fn(make_examples(32))  # 8 per data shard x 4 data shards

    def trainer(accumulate):
        return Trainer(Deployer(jax_seed=0, n_model_shards=2, verbose=False), collate_fn,
                       model.apply, loss_fn, params, optax.sgd(0.1),
                       accumulate_grad_batches=accumulate)
    one, two = trainer(1).step_cost(micro), trainer(2)
    stacked = jax.tree_util.tree_map(lambda x: np.stack([x, x]), micro)
    cost = two.step_cost(stacked)
    assert (cost.examples, cost.tokens) == (2 * one.examples, 2 * one.tokens)
    assert cost.flops_per_device == pytest.approx(2 * one.flops_per_device, rel=1e-12)
    with pytest.raises(ConfigError, match=r"accumulate_grad_batches=2.*Fix: stack 2"):
        trainer(2).step_cost(micro)
