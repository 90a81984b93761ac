"""Training on 8 simulated devices equals training on one, whatever the sharding."""

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from redcoast import Deployer, Trainer
from tiny_lm import (assert_trees_close, collate_fn, example_losses, loss_fn, make_examples,
                     make_model, reference_train)

N_STEPS = 4
# SGD with momentum is linear in the gradients, so rounding differences between shardings stay
# at rounding size. Adam-like optimizers normalise each update, which turns the rounding noise
# of parameters with a (near-)zero gradient into lr-sized differences: they are compared on a
# model without such parameters in test_optimizers.py.
OPTIMIZER = optax.sgd(0.1, momentum=0.9)


def fit_sharded(n_model_shards, per_device_batch_size, accumulate=1, optimizer=None, n_epochs=1,
                examples=None, **fit_kwargs):
    model, params = make_model()
    deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, verbose=False)
    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params,
                      optimizer or OPTIMIZER, accumulate_grad_batches=accumulate)
    trainer.fit(examples, per_device_batch_size, n_epochs, shuffle=False, **fit_kwargs)
    return trainer


# every mesh shape once (8x1, 4x2, 2x4, 1x8), accumulation on two of them: the other products
# added nothing these do not check (four more runs, about 100 s of CI's third step)
@pytest.mark.parametrize("n_model_shards, accumulate", [(1, 2), (2, 2), (4, 1), (8, 1)],
                         ids=["1-2", "2-2", "4-1", "8-1"])
def test_sharded_training_equals_single_device(n_model_shards, accumulate):
    dp = 8 // n_model_shards
    per_device = 2
    step_size = per_device * dp * accumulate
    examples = make_examples(step_size * N_STEPS)
    trainer = fit_sharded(n_model_shards, per_device, accumulate, examples=examples)
    assert trainer.step == N_STEPS

    model, params = make_model()
    batches = [collate_fn(examples[i * step_size:(i + 1) * step_size]) for i in range(N_STEPS)]
    expected = reference_train(model, params, OPTIMIZER, batches)
    assert_trees_close(trainer.params, expected)


def test_accumulating_k_micro_batches_equals_one_k_times_bigger_batch():
    examples = make_examples(64)
    k = 4
    accumulated = fit_sharded(2, 1, accumulate=k, examples=examples)
    big = fit_sharded(2, k, accumulate=1, examples=examples)
    assert accumulated.step == big.step == 64 // (4 * k)
    assert_trees_close(accumulated.params, big.params)


def test_parameters_are_sharded_as_planned():
    trainer = fit_sharded(2, 1, examples=make_examples(8))
    kernel = trainer.params["block_0"]["fc_in"]["kernel"]  # (32, 128), column-parallel
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "mp")
    assert kernel.addressable_shards[0].data.shape == (32, 64)
    mu = trainer.state.opt_state[0].trace["block_0"]["fc_in"]["kernel"]
    assert mu.sharding.spec == kernel.sharding.spec


def test_bf16_compute_trains_with_fp32_master_params():
    seen = []

    def recording_loss(rng, state, params, batch, is_training):
        seen.append(params["head"]["kernel"].dtype)
        return loss_fn(rng, state, params, batch, is_training)

    model, params = make_model()
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)
    trainer = Trainer(deployer, collate_fn, model.apply, recording_loss, params, optax.adamw(1e-2),
                      compute_dtype=jnp.bfloat16)
    examples = make_examples(64)
    before = trainer.eval_loss(examples, 2)
    trainer.fit(examples, 2, 3)
    after = trainer.eval_loss(examples, 2)
    assert after < 0.7 * before, (before, after)
    assert set(seen) == {jnp.dtype(jnp.bfloat16)}
    for leaf in jax.tree_util.tree_leaves(trainer.params):
        assert leaf.dtype == jnp.float32
    for leaf in jax.tree_util.tree_leaves(trainer.state.opt_state):
        assert leaf.dtype in (jnp.float32, jnp.int32)


@pytest.mark.parametrize("n_eval", [13, 4, 1])
def test_eval_loss_is_the_exact_mean_over_examples(n_eval):
    model, params = make_model()
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)  # global batch 4 * 2 = 8
    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.adamw(1e-2))
    examples = make_examples(n_eval, seed=3)
    expected = example_losses(model, params, examples).mean()
    assert trainer.eval_loss(examples, per_device_batch_size=2) == pytest.approx(expected, rel=1e-5)
    # evaluate: the same means for the loss and for every metric loss_fn returns
    state = types.SimpleNamespace(apply_fn=model.apply)
    acc = jax.jit(lambda b: loss_fn(jax.random.PRNGKey(0), state, params, b, False)[1]["acc"])
    results = trainer.evaluate(examples, per_device_batch_size=2)
    assert sorted(results) == ["acc", "loss"]
    assert results["loss"] == pytest.approx(expected, rel=1e-5)
    want_acc = np.mean([float(acc(collate_fn([e]))) for e in examples])  # one at a time, one device
    assert results["acc"] == pytest.approx(want_acc, rel=1e-5)


def test_lr_schedule_counts_optimizer_updates_not_micro_batches():
    model, params = make_model()
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)
    k, per_device, n, epochs = 4, 1, 96, 2  # 4 data shards: 16 examples per update, 6 per epoch
    schedule = deployer.get_lr_schedule_fn(n, per_device, epochs, 1e-2, schedule_type="linear",
                                           warmup_steps=3, accumulate_grad_batches=k)
    assert float(schedule(3)) == pytest.approx(1e-2)
    assert float(schedule(12)) == pytest.approx(0.0, abs=1e-9)
    assert float(schedule(11)) > 0
    cosine = deployer.get_lr_schedule_fn(n, per_device, epochs, 1e-2, schedule_type="cosine",
                                         warmup_rate=0.25, accumulate_grad_batches=k)
    assert float(cosine(3)) == pytest.approx(1e-2)
    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params,
                      optax.adamw(schedule), lr_schedule_fn=schedule, accumulate_grad_batches=k)
    trainer.fit(make_examples(n), per_device, epochs)
    assert trainer.step == 12
    assert int(trainer.state.opt_state[-1].count) == 12  # the schedule's own counter


def test_same_seed_same_run_and_epochs_are_shuffled_differently():
    def run(seed):
        model, params = make_model(dropout=0.1)
        deployer = Deployer(jax_seed=seed, n_model_shards=2, verbose=False)
        # a fixed layout: the seed's effects are the subject, not the choice among candidates
        trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.adamw(1e-2),
                          fsdp=False, fuse_matmuls=False)
        trainer.fit(make_examples(32), 1, 2)
        return trainer.params

    a, b, c = run(0), run(0), run(1)
    assert_trees_close(a, b, rtol=0, atol=0)
    assert not np.allclose(a["head"]["kernel"], c["head"]["kernel"])
    from redcoast.data import epoch_order
    assert not np.array_equal(epoch_order(32, 0, 0), epoch_order(32, 0, 1))
    assert sorted(epoch_order(32, 0, 1)) == list(range(32))


def test_dropout_randomness_does_not_depend_on_the_sharding():
    def run(n_model_shards):
        model, params = make_model(dropout=0.2)
        deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, verbose=False)
        trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.sgd(1e-1))
        trainer.fit(make_examples(16), 8 // (8 // n_model_shards), 1, shuffle=False)
        return trainer.params

    assert_trees_close(run(2), run(8))


def test_huggingface_dataset_as_examples():
    datasets = pytest.importorskip("datasets")
    examples = make_examples(16)
    dataset = datasets.Dataset.from_dict({"ids": [e["ids"].tolist() for e in examples]})
    trainer = fit_sharded(2, 1, examples=dataset)
    reference = fit_sharded(2, 1, examples=examples)
    assert_trees_close(trainer.params, reference.params, rtol=0, atol=0)


def test_metrics_and_logs_are_written(tmp_path):
    model, params = make_model()
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(tmp_path), verbose=True,
                        run_tensorboard=True)
    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.adamw(1e-2))
    examples = make_examples(32)
    trainer.fit(examples, 1, 1, eval_examples=examples[:5], log_every_n_steps=4,
                save_last_ckpt=True, save_argmin_ckpt_by_metrics=["loss"])
    import json
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train_loss" in r]
    assert [r["step"] for r in train] == [4, 8]
    assert all({"train_acc", "train_examples_per_s"} <= set(r) for r in train)
    assert any("eval_loss" in r for r in records)
    assert "Sharding plan" in (tmp_path / "log.txt").read_text()
    assert list((tmp_path / "tensorboard").iterdir())
    steps = [s for s in os.listdir(tmp_path / "checkpoints" / "steps") if s.isdigit()]
    assert steps == ["8"]
    assert os.listdir(tmp_path / "checkpoints" / "best_min_loss") == ["8"]
