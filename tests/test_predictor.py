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


def test_sampling_is_fresh_on_each_call_and_repeats_with_the_same_rng(deployer):
    # as redco draws a key per batch: sampling twice gives two samples (GRPO's rollouts, several
    # completions per prompt); a key given by the caller gives the same predictions again
    import jax
    model, params = make_model()
    examples = make_examples(6)
    predictor = Predictor(deployer, collate_fn,
                          lambda rng, p, b: jax.random.randint(rng, b["ids"].shape, 0, 1 << 30))
    first, second = (np.stack(predictor.predict(examples, 1, params)) for _ in range(2))
    assert not np.array_equal(first, second)
    key = jax.random.key(3)
    again = [np.stack(predictor.predict(examples, 1, params, rng=key)) for _ in range(2)]
    np.testing.assert_array_equal(*again)


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


def test_laid_out_params_are_used_where_they_are_on_their_own_mesh():
    # the Predictor reads the placement from the arrays it is given (no link to a Trainer): the
    # same parameters laid out on 4 model shards (FSDP-split over 'dp' where large) and as host
    # arrays give the same outputs, each on its own mesh, each with its own compiled step
    import jax
    import optax
    from redcoast import Trainer
    from tiny_lm import loss_fn
    model, params = make_model()
    trainer = Trainer(Deployer(n_model_shards=4, verbose=False), collate_fn, model.apply, loss_fn,
                      params, optax.sgd(0.0), fsdp=True)
    trainer.fit(make_examples(8), per_device_batch_size=4, n_epochs=1)  # settles the layout
    placed = trainer.params
    predictor = Predictor(Deployer(n_model_shards=1, verbose=False), collate_fn,
                          lambda rng, p, b: model.apply({"params": p}, b["ids"][:, :-1]).argmax(-1))
    examples = make_examples(6)
    on_trainer_mesh = predictor.predict(examples, 1, placed)  # 2 data shards: 2 per batch
    host = predictor.predict(examples, 1, jax.device_get(placed))  # 8 data shards
    np.testing.assert_array_equal(np.stack(on_trainer_mesh), np.stack(host))
    # stored split over 'dp' as FSDP does (every leaf whose first axis 'dp' divides): gathered where used
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = trainer.mesh
    split = jax.tree_util.tree_map(lambda x: jax.device_put(x, NamedSharding(
        mesh, P("dp") if x.ndim and x.shape[0] % 2 == 0 else P())), jax.device_get(placed))
    np.testing.assert_array_equal(np.stack(predictor.predict(examples, 1, split)), np.stack(host))
    meshes = [mesh for mesh, _, _ in predictor._compiled.values()]
    assert [dict(m.shape) for m in meshes] == [{"dp": 2, "mp": 4}, {"dp": 8, "mp": 1}, {"dp": 2, "mp": 4}]


def test_a_list_of_per_example_rows_is_refused_with_the_fix(deployer):
    """Rows as long as the batch (4 data shards x 2 = 8) would come back transposed."""
    _, params = make_model()
    rows = lambda rng, p, b: [b["ids"][i, :8] for i in range(8)]  # noqa: E731
    from redcoast.errors import DataError
    with pytest.raises(DataError, match=r"(?s)Python list of 8 arrays.*per-example rows.*jnp\.stack"):
        Predictor(deployer, collate_fn, rows).predict(make_examples(8), 2, params)
    stacked = lambda rng, p, b: jnp.stack([b["ids"][i, :8] for i in range(8)])  # noqa: E731
    examples = make_examples(8)
    outputs = Predictor(deployer, collate_fn, stacked).predict(examples, 2, params)
    np.testing.assert_array_equal(outputs[3], examples[3]["ids"][:8])
    # a tuple of fields of other shapes is no list of rows
    fields = lambda rng, p, b: (b["ids"][:, 0], b["ids"][:, :2])  # noqa: E731
    first, pair = Predictor(deployer, collate_fn, fields).predict(examples, 2, params)[5]
    assert int(first) == examples[5]["ids"][0] and pair.shape == (2,)


def test_predict_reads_a_generator(deployer):
    _, params = make_model()
    examples = make_examples(6)
    predictor = Predictor(deployer, collate_fn, pred_fn)
    outputs = predictor.predict((e for e in examples), 1, params)
    assert [int(o["first"]) for o in outputs] == [int(e["ids"][0]) * 2 for e in examples]


def test_params_with_keys_1_and_str_1_name_the_dict(deployer):
    from redcoast.errors import ConfigError
    _, params = make_model()
    params["head"] = {1: params["head"]["bias"], "1": params["head"]["bias"]}
    with pytest.raises(ConfigError, match=r"params\['head'\] has keys 1 and '1'.*Fix"):
        Predictor(deployer, collate_fn, pred_fn).predict(make_examples(2), 1, params)
