"""A Trainer from abstract parameters (jax.ShapeDtypeStruct): it plans and compiles without
allocating, refuses to train, and trains like one built from real parameters once given them."""

import importlib.util
import os

import jax
import numpy as np
import optax
import pytest

from redcoast import ConfigError, Deployer, Trainer

_spec = importlib.util.spec_from_file_location(
    "comms_models", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "comms_models.py"))
zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zoo)


def collate(examples):
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def examples():
    batch = zoo.batch()
    return [{k: v[i] for k, v in batch.items()} for i in range(zoo.B)] * 2


def trainer(model, loss, params):
    return Trainer(Deployer(jax_seed=0, n_model_shards=4, verbose=False), collate, model.apply,
                   loss(model), params, optax.adamw(1e-3))


@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama_gqa4", marks=pytest.mark.slow)])
# gpt2: c_attn stored permuted; llama_gqa4: K/V kept by groups of shards
def test_abstract_trainer_compiles_as_a_real_one_then_trains_like_it(name):
    make, loss, _ = zoo.MODELS[name]
    model = make(2)
    abstract = trainer(model, loss, model.abstract_params())
    assert abstract.is_abstract
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(abstract.params))
    real = trainer(model, loss, model.init(0))
    memory = [t.compile_train_step(zoo.batch()).memory_analysis() for t in (abstract, real)]
    assert abstract.layout.name == real.layout.name
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
        assert getattr(memory[0], field) == getattr(memory[1], field), field
    for doing in (lambda t: t.fit(examples(), 4, 1), lambda t: t.eval_loss(examples(), 4),
                  lambda t: t.train(examples(), 4), lambda t: t.save_params("/nonexistent/x")):
        with pytest.raises(ConfigError, match="abstract parameters"):
            doing(abstract)

    abstract.set_params(model.init(0))
    assert not abstract.is_abstract
    for t in (abstract, real):
        t.fit(examples(), 4, 1, shuffle=False)
    for a, b in zip(jax.tree_util.tree_leaves(abstract.params), jax.tree_util.tree_leaves(real.params)):
        np.testing.assert_array_equal(a, b)


def test_params_mixing_shapes_and_arrays_are_refused():
    make, loss, _ = zoo.MODELS["llama"]
    model = make(1)
    params = model.abstract_params()
    params["lm_head"] = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), params["lm_head"])
    with pytest.raises(ConfigError, match="mix jax.ShapeDtypeStruct"):
        trainer(model, loss, params)


def test_a_deployer_on_some_of_the_devices_trains_on_those_alone():
    """``Deployer(devices=...)``: the mesh, the layout and the state keep to the devices given
    (what ``redcoast plan --target`` gives a TPU slice's compile-only devices)."""
    make, loss, _ = zoo.MODELS["gpt2"]
    model = make(1)
    some = jax.devices()[4:]
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False, devices=some)
    assert deployer.mesh.shape == {"dp": 2, "mp": 2} and deployer.model_shard_candidates() == [1, 2, 4]
    t = Trainer(deployer, collate, model.apply, loss(model), model.init(0), optax.adamw(1e-3))
    t.fit(examples(), 2, 1)
    assert {d for x in jax.tree_util.tree_leaves(t.params) for d in x.devices()} == set(some)
