"""Every mistake a user can make gets one clear message naming the cause and the fix."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from redcoast import (ConfigError, DataError, Deployer, LossError, NonFiniteLossError, Predictor,
                      Trainer)
from tiny_lm import (collate_fn, ignore_index_collate, loss_fn, make_examples, make_model,
                     masked_loss)


@pytest.fixture(scope="module")
def deployer():
    return Deployer(n_model_shards=2, verbose=False)


def make_trainer(deployer, loss=loss_fn, collate=collate_fn, **kwargs):
    model, params = make_model()
    return Trainer(deployer, collate, model.apply, loss, params, optax.adamw(1e-2), **kwargs)


def test_model_shards_must_divide_the_devices():
    with pytest.raises(ConfigError, match=r"n_model_shards=3 does not divide the 8 .*\[1, 2, 4, 8\]"):
        Deployer(n_model_shards=3, verbose=False)


@pytest.mark.parametrize("collate, message", [
    (lambda exs: {"ids": [list(range(len(e["ids"]) - i)) for i, e in enumerate(exs)]},
     r"ragged value for key 'ids'.*pad every row"),
    (lambda exs: {"ids": collate_fn(exs)["ids"], "text": np.array(["a"] * len(exs))},
     r"non-numeric data for key 'text'"),
    (lambda exs: {"ids": collate_fn(exs)["ids"], "mask": np.ones((len(exs) + 1, 3))},
     r"given 4 examples but returned 5 rows .* for key 'mask'"),
    (lambda exs: [e["ids"] for e in exs], r"returned a list; redcoast needs a dict"),
])
def test_bad_collate_output(deployer, collate, message):
    trainer = make_trainer(deployer, collate=collate)
    with pytest.raises(DataError, match=message):
        trainer.train(make_examples(8), 1)


def test_loss_must_be_a_scalar(deployer):
    def per_example_loss(rng, state, params, batch, is_training):
        return jnp.zeros(batch["ids"].shape[0]) + loss_fn(rng, state, params, batch, is_training)[0]

    with pytest.raises(LossError, match=r"loss of shape \(4,\); it must be a scalar"):
        make_trainer(deployer, loss=per_example_loss).train(make_examples(8), 1)


def test_nan_loss_stops_names_the_step_and_saves_nothing(tmp_path):
    deployer = Deployer(n_model_shards=2, verbose=False, workdir=str(tmp_path))

    def exploding_loss(rng, state, params, batch, is_training):
        loss, metrics = loss_fn(rng, state, params, batch, is_training)
        return jnp.where(state.step == 3, jnp.nan, loss), metrics

    trainer = make_trainer(deployer, loss=exploding_loss)
    with pytest.raises(NonFiniteLossError, match=r"became nan at step 3 .*no checkpoint was "
                                                 r"written.*lower the learning rate.*-100"):
        trainer.fit(make_examples(48), 1, 1, log_every_n_steps=5, save_last_ckpt=True)
    steps_dir = tmp_path / "checkpoints" / "steps"
    assert not [s for s in os.listdir(steps_dir) if s.isdigit()]
    # found at the first logging interval after it (step 5); updates 3 and 4 were not applied
    assert trainer.step == 3 and int(trainer.state.step) == 3


def test_a_nan_loss_before_any_update_names_the_minus_100_labels_not_the_learning_rate(deployer):
    trainer = make_trainer(deployer, loss=masked_loss, collate=ignore_index_collate)
    with pytest.raises(NonFiniteLossError, match=(
            r"at step 0 .*the learning rate is not the cause.*Found: batch\['labels'\] holds "
            r"negative values \(the smallest -100: -100 is PyTorch ignore_index\)")):
        trainer.train(make_examples(16), 1)


def test_a_nan_evaluation_loss_is_said_with_its_cause(deployer, capsys):
    trainer = make_trainer(deployer, loss=masked_loss, collate=ignore_index_collate)
    assert np.isnan(trainer.eval_loss(make_examples(8), 1))
    assert re.search(r"WARNING: The evaluation loss is nan\. Found: batch\['labels'\] holds "
                     r"negative values \(the smallest -100", capsys.readouterr().err)


def test_a_nan_loss_before_any_update_names_token_ids_beyond_the_vocabulary(deployer):
    from redcoast.models import Model, llama
    model = Model(llama.LlamaForCausalLM, llama.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2))

    def lm_loss(rng, state, params, batch, is_training):
        logits = state.apply_fn(params, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()

    # a token added to the tokenizer (say a pad token) without resizing the embeddings
    def collate(examples):
        return {"ids": np.concatenate([collate_fn(examples)["ids"],
                                       np.full((len(examples), 1), 64)], axis=1)}
    trainer = Trainer(deployer, collate, model.apply, lm_loss, model.init(0), optax.sgd(0.1))
    with pytest.raises(NonFiniteLossError, match=r"batch\['ids'\] holds 64, at or above the "
                                                 r"model's vocab_size 64"):
        trainer.train(make_examples(16), 1)


def test_a_nan_loss_before_any_update_from_the_loss_or_the_parameters_says_which(deployer):
    def log_of_zero(rng, state, params, batch, is_training):
        return loss_fn(rng, state, params, batch, is_training)[0] + jnp.log(0.0) * 0.0

    with pytest.raises(NonFiniteLossError, match=r"no NaN, inf, negative or out-of-vocabulary "
                                                 r"value .*look at the loss"):
        make_trainer(deployer, loss=log_of_zero).train(make_examples(16), 1)
    trainer = make_trainer(deployer)
    params = jax.tree_util.tree_map(np.array, jax.device_get(trainer.params))  # writable
    params["head"]["kernel"][0, 0] = np.nan
    trainer.set_params(params)
    with pytest.raises(NonFiniteLossError, match=r"the parameters hold NaN or inf at "
                                                 r"\['params'\]\['head'\]\['kernel'\]"):
        trainer.train(make_examples(16), 1)


def test_batch_larger_than_the_data(deployer):
    with pytest.raises(ConfigError, match="do not fill one update"):
        make_trainer(deployer).train(make_examples(3), 1)


def test_prediction_outputs_must_have_a_batch_dimension(deployer):
    model, params = make_model()
    predictor = Predictor(deployer, collate_fn, lambda rng, p, batch: jnp.sum(batch["ids"]))
    with pytest.raises(DataError, match="pred_fn returned a scalar"):
        predictor.predict(make_examples(3), 1, params)


def test_params_keys_1_and_str_1_name_the_dict(deployer):
    model, params = make_model()
    params["block_1"]["fc_in"] = {1: params["block_1"]["fc_in"]["kernel"],
                                  "1": params["block_1"]["fc_in"]["kernel"]}
    with pytest.raises(ConfigError, match=r"params\['block_1'\]\['fc_in'\] has keys 1 and '1'.*Fix"):
        Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.adamw(1e-2))
    with pytest.raises(ConfigError, match=r"frozen_params\['a'\] has keys of types int and str"):
        Trainer(deployer, collate_fn, model.apply, loss_fn, make_model()[1], optax.adamw(1e-2),
                frozen_params={"a": {0: jnp.ones(2), "b": jnp.ones(2)}})
