"""redco 0.4.23's forms work on redcoast: each test writes a redco-style call and checks the result
against an answer computed by hand (numpy least squares, optax schedules, file contents)."""

import collections
import functools
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from redcoast import ConfigError, Deployer, Predictor, RedcoCompatWarning, Trainer
from redcoast.compat import AutoShardingRules
from redcoast.compat.calls import EVAL_METRIC_FN_ARGS, LOSS_FN_ARGS, PRED_FN_ARGS, by_keyword

N, D = 64, 4
_rng = np.random.default_rng(0)
X = _rng.normal(size=(N, D)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)).astype(np.float32)
EXAMPLES = [{"x": X[i], "y": Y[i]} for i in range(N)]


def collate_fn(examples):  # a UserDict, as a tokenizer's BatchEncoding is
    return collections.UserDict({"x": np.stack([e["x"] for e in examples]),
                                 "labels": np.array([e["y"] for e in examples])})


def loss_fn(state, batch, params, rng, is_training):  # redco called it by keyword: any order
    labels = batch.pop("labels")
    return jnp.mean((batch["x"] @ params["w"] - labels) ** 2)


def sgd_by_hand(w, lr, chunks):
    """Full-batch gradient descent on mean squared error, one update per chunk of examples."""
    for idx in chunks:
        x, y = X[idx], Y[idx]
        w = w - lr * 2.0 / len(idx) * x.T @ (x @ w - y)
    return w


def in_order_chunks(size, n_chunks):
    return [np.arange(i * size, (i + 1) * size) for i in range(n_chunks)]


def test_user_functions_are_called_by_keyword_where_they_name_the_argument():
    def pred_fn(rng, batch, params):
        return rng, batch, params
    assert by_keyword(pred_fn, PRED_FN_ARGS)("R", "P", "B") == ("R", "B", "P")

    def eval_metric_fn(preds, examples):
        return preds, examples
    assert by_keyword(eval_metric_fn, EVAL_METRIC_FN_ARGS)("E", "Q") == ("Q", "E")

    def maml_loss(train_rng, state, params, batch, is_training, model):  # first name differs
        return train_rng, state, params, batch, is_training, model
    called = by_keyword(functools.partial(maml_loss, model="M"), LOSS_FN_ARGS)
    assert called("R", "S", "P", {"b": 1}, True) == ("R", "S", "P", {"b": 1}, True, "M")
    assert by_keyword(lambda *a: a, LOSS_FN_ARGS)(1, 2, 3, 4, 5) == (1, 2, 3, 4, 5)
    by_name = by_keyword(lambda **kw: kw, PRED_FN_ARGS)("R", "P", "B")
    assert by_name == {"rng": "R", "params": "P", "batch": "B"}

    batch = {"x": 1, "labels": 2}
    popping = by_keyword(lambda rng, params, batch: batch.pop("labels"), PRED_FN_ARGS, copy_batch=True)
    assert popping(None, None, batch) == 2 and popping(None, None, batch) == 2
    assert batch == {"x": 1, "labels": 2}


def test_redco_lm_script_form_trains_as_sgd_by_hand_with_multisteps_unwrapped():
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)   # dp = 4
    k = deployer.get_accumulate_grad_batches(global_batch_size=16, per_device_batch_size=2)
    assert k == 2
    with pytest.warns(RedcoCompatWarning, match="MultiSteps"):
        trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=None, loss_fn=loss_fn,
                          params={"w": jnp.zeros(D)}, opt_state=None, params_sharded=True,
                          opt_state_sharded=True, last_ckpt_info=None,
                          optimizer=optax.MultiSteps(optax.sgd(0.1), every_k_schedule=k),
                          accumulate_grad_batches=k)
    trainer.train(EXAMPLES, per_device_batch_size=2, shuffle=False)
    assert trainer.step == N // 16   # 4 updates, not 4 / k (MultiSteps on top) nor 8
    expected = sgd_by_hand(np.zeros(D, np.float32), 0.1, in_order_chunks(16, N // 16))
    np.testing.assert_allclose(np.asarray(trainer.params["w"]), expected, rtol=1e-5, atol=1e-6)


def test_multisteps_that_cannot_be_unwrapped_is_refused():
    deployer = Deployer(jax_seed=0, verbose=False)
    params = {"model": {"w": jnp.zeros(D)}, "lora": {"w": jnp.zeros(D)}}
    with pytest.raises(ConfigError, match="disagree"):
        Trainer(deployer, collate_fn, None, loss_fn, {"w": jnp.zeros(D)},
                optax.MultiSteps(optax.sgd(0.1), every_k_schedule=3), accumulate_grad_batches=2)
    nested = optax.multi_transform(
        {"model": optax.set_to_zero(), "lora": optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)},
        {"model": "model", "lora": "lora"})
    with pytest.raises(ConfigError, match="2 x 2"):
        Trainer(deployer, collate_fn, None, loss_fn, params, nested, accumulate_grad_batches=2)


def test_batch_size_helpers_and_schedule_in_optimizer_updates():
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)
    assert deployer.get_local_global_micro_batch_size(per_device_batch_size=3) == (12, 12)
    assert deployer.process_batch_size(per_device_batch_size=3) == (12, 12)
    with pytest.raises(ConfigError, match="multiple of 8"):
        deployer.get_accumulate_grad_batches(global_batch_size=20, per_device_batch_size=2)
    plain = deployer.get_lr_schedule_fn(train_size=640, per_device_batch_size=2, n_epochs=1,
                                        learning_rate=1.0, warmup_ratio=0.25)
    # 640 / 8 = 80 updates, 20 of warmup: the independent answer from optax
    reference = optax.join_schedules([optax.linear_schedule(0.0, 1.0, 20),
                                      optax.linear_schedule(1.0, 0.0, 60)], [20])
    for step in (0, 10, 20, 50, 79):
        assert float(plain(step)) == pytest.approx(float(reference(step)))
    assert deployer.get_accumulate_grad_batches(global_batch_size=32, per_device_batch_size=2) == 4
    with pytest.warns(RedcoCompatWarning, match="optimizer updates"):
        per_update = deployer.get_lr_schedule_fn(train_size=640, per_device_batch_size=2, n_epochs=1,
                                                 learning_rate=1.0, warmup_ratio=0.25)
    reference = optax.join_schedules([optax.linear_schedule(0.0, 1.0, 5),
                                      optax.linear_schedule(1.0, 0.0, 15)], [5])  # 20 updates
    for step in (0, 3, 5, 12, 19):
        assert float(per_update(step)) == pytest.approx(float(reference(step)))


def test_log_info_keyword_and_rules_passed_back_mean_automatic(tmp_path):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(tmp_path))
    deployer.log_info(info=1234, title="accumulate_grad_batches")
    with open(tmp_path / "log.txt") as f:
        assert "1234" in f.read()
    params = {"dense": {"kernel": jnp.zeros((8, 16)), "bias": jnp.zeros(16)}}
    rules = deployer.get_sharding_rules(params_shape_or_params=params)
    assert isinstance(rules, AutoShardingRules) and rules
    automatic = deployer.get_sharding_plan(params).placements
    assert deployer.get_sharding_plan(params, rules).placements == automatic
    rules[0] = (("dense", "kernel"), P("mp"))   # edited: now the user's rule
    assert deployer.get_sharding_plan(params, rules).param_specs["dense"]["kernel"] == P("mp")


def test_rules_per_subtree():
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)
    params = {"model": {"a": {"kernel": jnp.zeros((8, 16))}, "b": {"kernel": jnp.zeros((16, 8))}},
              "lora": {"a": jnp.zeros((8, 2))}}
    rules = {"model": [(("a", "kernel"), P(None, "mp")), (("b", "kernel"), P())], "lora": None}
    specs = deployer.get_sharding_plan(params, rules).param_specs
    assert specs["model"]["a"]["kernel"] == P(None, "mp")
    assert specs["model"]["b"]["kernel"] == P()
    assert specs["lora"]["a"] == deployer.get_sharding_plan(params).param_specs["lora"]["a"]
    with pytest.raises(ConfigError, match="subtrees"):
        deployer.get_sharding_plan(params, {"encoder": []})


def test_redcos_lora_rules_per_subtree_train(tmp_path):
    """redco's LoRA example: {'model': deployer.get_sharding_rules(params['model']), 'lora': None}
    (the model's printed rules passed back, LoRA automatic) trains as the automatic plan would;
    edited rules for a subtree are the user's there."""
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)
    params = {"model": {"a": {"kernel": jnp.ones((8, 16))}, "b": {"kernel": jnp.ones((16, 8))}},
              "lora": {"a": jnp.ones((8, 2)), "b": jnp.zeros((2, 8))}}

    def loss_fn(train_rng, state, params, batch, is_training):
        model, lora = params["model"], params["lora"]
        hidden = jnp.tanh(batch["x"] @ model["a"]["kernel"]) @ model["b"]["kernel"]
        return jnp.mean((hidden + batch["x"] @ lora["a"] @ lora["b"]) ** 2)

    def collate(examples):
        return {"x": np.stack([e["x"] for e in examples])}

    def trainer_with(rules):
        return Trainer(deployer=deployer, collate_fn=collate, apply_fn=None, loss_fn=loss_fn,
                       params=params, optimizer=optax.adam(1e-3), params_sharding_rules=rules)
    automatic = trainer_with(None)
    redcos = trainer_with({"model": deployer.get_sharding_rules(params["model"]), "lora": None})
    examples = [{"x": np.full(8, i / 16, np.float32)} for i in range(16)]
    for t in (automatic, redcos):
        t.fit(train_examples=examples, per_device_batch_size=2, n_epochs=1)
    assert redcos.plan.param_specs == automatic.plan.param_specs
    assert automatic.plan.param_specs["model"]["a"]["kernel"] == P(None, "mp")  # a real plan
    for a, b in zip(jax.tree_util.tree_leaves(redcos.params), jax.tree_util.tree_leaves(automatic.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    mine = trainer_with({"model": [(("a", "kernel"), P()), ((".*",), P())], "lora": None})
    assert mine.plan.param_specs["model"]["a"]["kernel"] == P()


def test_redco_checkpoints_round_trip_without_pickle(tmp_path):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(tmp_path), verbose=False)
    params = {"dense": {"kernel": jnp.arange(32.0).reshape(4, 8)}}
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(params)
    opt_state = (opt_state[0]._replace(mu={"dense": {"kernel": jnp.full((4, 8), 2.0)}}),) + opt_state[1:]
    deployer.save_ckpt(ckpt_dir=str(tmp_path / "init"), params=params, opt_state=opt_state,
                       step=3, epoch_idx=1)
    assert not any(name.endswith(".pkl") for name in os.listdir(tmp_path / "init"))
    ckpt, info = deployer.load_ckpt(ckpt_dir=str(tmp_path / "init"), optimizer=optimizer,
                                    float_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(ckpt["params"]["dense"]["kernel"]),
                                  np.arange(32.0).reshape(4, 8))
    np.testing.assert_array_equal(np.asarray(ckpt["opt_state"][0].mu["dense"]["kernel"]), 2.0)
    assert info["step"] == 3 and info["epoch_idx"] == 1

    with pytest.warns(RedcoCompatWarning, match="resumes by itself"):
        assert deployer.load_last_ckpt(optimizer=optimizer) == (None, None)
    def zero_loss(rng, state, params, batch, is_training):
        return 0.0 * jnp.sum(params["dense"]["kernel"])

    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=None, loss_fn=zero_loss,
                      params=ckpt["params"], opt_state=ckpt["opt_state"], optimizer=optimizer,
                      last_ckpt_info=info)
    assert trainer.step == 3 and trainer.progress.epoch == 2
    np.testing.assert_array_equal(np.asarray(trainer.state.opt_state[0].mu["dense"]["kernel"]), 2.0)
    trainer.save_ckpt(epoch_idx=4, ckpt_name="last", save_opt_state=False, float_dtype=jnp.bfloat16)
    ckpt, info = deployer.load_last_ckpt(optimizer=optimizer)
    assert info["epoch_idx"] == 4 and ckpt["opt_state"] is None
    assert ckpt["params"]["dense"]["kernel"].dtype == jnp.bfloat16


def test_train_examples_as_a_function_of_the_epoch_or_a_generator():
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)
    trainer = Trainer(deployer, collate_fn, None, loss_fn, {"w": jnp.zeros(D)}, optax.sgd(0.05))
    asked = []

    def examples_of_epoch(epoch_idx):
        asked.append(epoch_idx)
        return EXAMPLES[: 16 * (epoch_idx + 1)]   # 2 updates of 8, then 4

    trainer.fit(train_examples=examples_of_epoch, per_device_batch_size=2, n_epochs=2)
    assert sorted(set(asked)) == [0, 1] and trainer.step == 2 + 4

    # a generator (redcoast's addition) is streamed in order, read once: one epoch of it
    trainer = Trainer(deployer, collate_fn, None, loss_fn, {"w": jnp.zeros(D)}, optax.sgd(0.05))
    trainer.fit(train_examples=(e for e in EXAMPLES), per_device_batch_size=2, n_epochs=1)
    assert trainer.step == N // 8
    expected = sgd_by_hand(np.zeros(D, np.float32), 0.05, in_order_chunks(8, N // 8))
    np.testing.assert_allclose(np.asarray(trainer.params["w"]), expected, rtol=1e-5, atol=1e-6)


def redco_style_step(rng, state, batch, loss_fn, lr_schedule_fn, mesh, compute_dtype):
    """redco's custom-step form, written fresh: one loss per data shard, gradients averaged."""
    def loss_and_grads(rng_, batch_):
        return jax.value_and_grad(lambda p: loss_fn(rng=rng_, state=state, params=p, batch=batch_,
                                                    is_training=True))(state.params)
    loss, grads = jax.vmap(loss_and_grads)(jax.random.split(rng, mesh.shape["dp"]), batch)
    grads = jax.tree_util.tree_map(lambda g: g.mean(axis=0), grads)
    return state.apply_gradients(grads=grads), {"loss": loss.mean(), "step": state.step}


def test_redco_train_step_fn_trains_like_the_builtin_step():
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=None, loss_fn=loss_fn,
                      params={"w": jnp.zeros(D)}, optimizer=optax.sgd(0.1),
                      train_step_fn=redco_style_step)
    trainer.train(EXAMPLES, per_device_batch_size=2, shuffle=False)
    expected = sgd_by_hand(np.zeros(D, np.float32), 0.1, in_order_chunks(8, N // 8))
    np.testing.assert_allclose(np.asarray(trainer.params["w"]), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match=r"train_step_fn\(state, batch, rng\)"):
        Trainer(deployer, collate_fn, None, loss_fn, {"w": jnp.zeros(D)}, optax.sgd(0.1),
                train_step_fn=lambda state, batch: (state, {}))


@pytest.mark.parametrize("returns, what", [
    (lambda new, metrics: new, "the new state alone"),
    (lambda new, metrics: (new, metrics, 0), "a tuple of 3"),
    (lambda new, metrics: (new.params, metrics), "not shaped as the state")])
def test_a_train_step_fn_returning_other_than_state_and_metrics_is_named(returns, what):
    def step(state, batch, rng):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(
            rng=rng, state=state, params=p, batch=batch, is_training=True))(state.params)
        return returns(state.apply_gradients(grads=grads), {"loss": loss})

    deployer = Deployer(jax_seed=0, verbose=False)
    trainer = Trainer(deployer, collate_fn, None, loss_fn, {"w": jnp.zeros(D)}, optax.sgd(0.1),
                      train_step_fn=step)
    with pytest.raises(ConfigError, match=rf"train_step_fn returned .*{what}.*Fix: end it with"):
        trainer.train(EXAMPLES, per_device_batch_size=1, shuffle=False)
    assert trainer.step == 0


def test_frozen_optimizer_labels_and_set_train_state_and_predictor():
    deployer = Deployer(jax_seed=0, verbose=False)
    params = {"model": {"w": jnp.zeros(D)}, "lora": {"w": jnp.zeros(D)}}
    labels = flax.core.freeze({"model": {"w": "model"}, "lora": {"w": "lora"}})
    optimizer = optax.multi_transform({"model": optax.set_to_zero(), "lora": optax.sgd(0.1)}, labels)

    def two_part_loss(rng, state, params, batch, is_training):
        w = params["model"]["w"] + params["lora"]["w"]
        return jnp.mean((batch["x"] @ w - batch["labels"]) ** 2)

    with pytest.warns(RedcoCompatWarning, match="FrozenDict"):
        trainer = Trainer(deployer, collate_fn, None, two_part_loss, params, optimizer)
    trainer.train(EXAMPLES, per_device_batch_size=1, shuffle=False)
    expected = sgd_by_hand(np.zeros(D, np.float32), 0.1, in_order_chunks(8, N // 8))
    np.testing.assert_array_equal(np.asarray(trainer.params["model"]["w"]), 0.0)
    np.testing.assert_allclose(np.asarray(trainer.params["lora"]["w"]), expected, rtol=1e-5, atol=1e-6)

    start = {"model": {"w": jnp.ones(D)}, "lora": {"w": jnp.zeros(D)}}   # a FedAvg client's round
    trainer.set_train_state(apply_fn=None, params=flax.core.freeze(start), optimizer=optimizer, step=0)
    assert trainer.step == 0
    trainer.train(EXAMPLES[:8], per_device_batch_size=1, shuffle=False)
    assert trainer.step == 1
    np.testing.assert_array_equal(np.asarray(trainer.params["model"]["w"]), 1.0)

    def pred_fn(rng, batch, params):   # redco called pred_fn(rng=, params=, batch=)
        return batch["x"] @ (params["model"]["w"] + params["lora"]["w"])

    predictor = Predictor(deployer=deployer, collate_fn=collate_fn, pred_fn=pred_fn)
    preds = predictor.predict(examples=EXAMPLES[:13], per_device_batch_size=1, params=start,
                              params_replicated=True, params_sharded=False)
    np.testing.assert_allclose(np.array(preds), X[:13] @ np.ones(D, np.float32), rtol=1e-5)


def test_fit_takes_redco_keywords(tmp_path):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(tmp_path), verbose=False)
    trainer = Trainer(deployer, collate_fn, None, loss_fn, {"w": jnp.zeros(D)}, optax.sgd(0.05))
    seen = []

    def eval_metric_fn(preds, examples):   # redco called eval_metric_fn(examples=, preds=)
        seen.append(len(examples))
        return {"mse": float(np.mean((np.array(preds) - np.array([e["y"] for e in examples])) ** 2))}

    predictor = Predictor(deployer, collate_fn, lambda rng, params, batch: batch["x"] @ params["w"])
    with pytest.warns(RedcoCompatWarning) as caught:
        trainer.fit(train_examples=EXAMPLES, per_device_batch_size=2, n_epochs=1,
                    eval_examples=EXAMPLES[:12], eval_predictor=predictor,
                    eval_metric_fn=eval_metric_fn, eval_sanity_check=True,
                    save_ckpt_every_k_epochs=1, save_opt_states=False, save_float_dtype=jnp.bfloat16)
    assert {str(w.message).split(":")[0] for w in caught} >= {"fit(save_opt_states=False)",
                                                              "fit(save_float_dtype=bfloat16)"}
    assert seen == [8, 12]   # the sanity check's one batch, then the evaluation
    assert os.listdir(tmp_path / "checkpoints" / "steps") == [str(N // 8)]
