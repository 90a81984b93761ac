"""Predictions come back complete, one per example, in input order."""

import jax.numpy as jnp
import numpy as np
import pytest

from redcoast import Deployer, Predictor
from tiny_lm import collate_fn, make_examples, make_model


@pytest.fixture(scope="module")
def deployer():
    return Deployer(n_model_shards=2, verbose=False)  # 4 data shards


def pred_fn(rng, params, batch):
    # depends on the example and on the sharded parameters
    return {"first": batch["ids"][:, 0] * 2, "head_sum": batch["ids"][:, :1] * 0 + jnp.sum(params["head"]["bias"])}


@pytest.mark.parametrize("n", [1, 7, 13])
def test_complete_and_in_order(deployer, n):
    model, params = make_model()
    params["head"]["bias"] = params["head"]["bias"] + 1.0
    examples = make_examples(n, seed=n)
    outputs = Predictor(deployer, collate_fn, pred_fn).predict(examples, 1, params)  # batch 4
    assert len(outputs) == n
    assert [int(o["first"]) for o in outputs] == [int(e["ids"][0]) * 2 for e in examples]
    assert all(float(o["head_sum"][0]) == pytest.approx(32.0) for o in outputs)


def test_output_fn_gets_host_batches(deployer):
    model, params = make_model()
    examples = make_examples(7)
    predictor = Predictor(deployer, collate_fn, lambda rng, p, b: b["ids"][:, :3],
                          output_fn=lambda batch: ["-".join(map(str, row)) for row in batch])
    outputs = predictor.predict(examples, 2, params)  # batch 8: one padded batch
    assert outputs == ["-".join(map(str, e["ids"][:3])) for e in examples]


def test_generation_with_trained_params_via_trainer(deployer):
    import optax
    from redcoast import Trainer
    from tiny_lm import loss_fn
    model, params = make_model()
    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.adamw(1e-2))
    predictor = trainer.get_default_predictor(
        lambda rng, p, b: model.apply({"params": p}, b["ids"][:, :-1]).argmax(-1))
    outputs = predictor.predict(make_examples(5), 1, trainer.params)
    assert len(outputs) == 5 and outputs[0].shape == (12,)
    assert np.issubdtype(outputs[0].dtype, np.integer)
