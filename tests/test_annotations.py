"""Sharding annotations in the model (Flax NNX and linen) are the user's placement: trained with
exactly those shardings, reported in the plan, and what cannot be mapped is said."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from redcoast import Deployer, Trainer

N = 32


def examples():
    rng = np.random.RandomState(0)
    x = rng.normal(size=(N, 4)).astype(np.float32)
    return [{"x": xi, "y": np.tanh(xi).astype(np.float32)} for xi in x]


def collate(rows):
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def nnx_mlp(partitioning=True):
    from flax import nnx

    def init(names):
        base = nnx.initializers.lecun_normal()
        return nnx.with_partitioning(base, names) if partitioning else base

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(4, 16, kernel_init=init((None, "model")), rngs=rngs)
            self.mid = nnx.Linear(16, 16, kernel_init=init(("data", "model")), rngs=rngs)
            self.down = nnx.Linear(16, 4, kernel_init=init(("model", None)), rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.mid(jax.nn.relu(self.up(x)))))

    with nnx.use_eager_sharding(False):  # plain arrays with the names as metadata
        return MLP(nnx.Rngs(0))


def nnx_loss(rng, state, module, batch, is_training):
    return jnp.mean((module(batch["x"]) - batch["y"]) ** 2)


EXPECTED = {("up", "kernel", "value"): P(None, "mp"), ("mid", "kernel", "value"): P("dp", "mp"),
            ("down", "kernel", "value"): P("mp")}


@pytest.mark.slow  # 6 s: two Trainers, two epochs each
def test_an_nnx_model_trains_with_exactly_its_annotated_shardings():
    from flax import nnx
    trainer = Trainer(Deployer(jax_seed=0, n_model_shards=4, verbose=False), collate, None,
                      nnx_loss, nnx_mlp(), optax.adam(1e-2))  # fsdp and fusion left to redcoast
    trainer.fit(examples(), 4, 2)  # 2 data shards: 8 a batch
    placements = {pl.path: pl for pl in trainer.plan.placements}
    for path, spec in EXPECTED.items():
        assert placements[path].spec == spec, (path, placements[path])
        assert placements[path].reason.startswith("annotation (nnx"), placements[path].reason
    leaves = dict((tuple(str(getattr(k, "name", getattr(k, "key", k))) for k in kp), leaf)
                  for kp, leaf in jax.tree_util.tree_flatten_with_path(trainer.params)[0])
    for path, spec in EXPECTED.items():  # the arrays themselves, as stored and returned
        assert leaves[path].sharding.spec == spec, (path, leaves[path].sharding)
    assert "annotation (nnx " in trainer.plan.table()  # the key's name depends on Flax's release
    # the same training on one model shard without annotations: the same numbers
    plain = Trainer(Deployer(jax_seed=0, n_model_shards=1, verbose=False), collate, None,
                    nnx_loss, nnx_mlp(partitioning=False), optax.adam(1e-2))
    plain.fit(examples(), 1, 2)  # 8 data shards: 8 a batch
    for a, b in zip(jax.tree_util.tree_leaves(nnx.state(trainer.params)),
                    jax.tree_util.tree_leaves(nnx.state(plain.params)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def linen_mlp_params(names):
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), names))(x)
            return nn.Dense(4)(jax.nn.relu(x))

    model = MLP()
    return model, model.init(jax.random.PRNGKey(0), jnp.ones((1, 4)))["params"]


def test_linen_logical_annotations_follow_flax_s_rules_in_effect():
    from flax.core import spmd
    model, params = linen_mlp_params(("embed", "mlp"))

    def loss(rng, state, params, batch, is_training):
        return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    spmd.set_logical_axis_rules([("embed", None), ("mlp", "model")])
    try:
        trainer = Trainer(Deployer(jax_seed=0, n_model_shards=4, verbose=False), collate, None,
                          loss, params, optax.sgd(0.1), fsdp=False)
        trainer.fit(examples(), 2, 1)
    finally:
        spmd.set_logical_axis_rules(())
    [kernel] = [pl for pl in trainer.plan.placements if pl.path[:2] == ("Dense_0", "kernel")]
    assert kernel.spec == P(None, "mp") and "LogicallyPartitioned ('embed', 'mlp')" in kernel.reason


def test_an_annotation_naming_an_unmapped_axis_is_said_and_left_to_the_plan():
    model, params = linen_mlp_params(("embed", "heads"))

    def loss(rng, state, params, batch, is_training):
        return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    with pytest.warns(UserWarning, match=r"names 'embed', 'heads'.*not applied.*Fix: set the rules"):
        trainer = Trainer(Deployer(jax_seed=0, n_model_shards=4, verbose=False), collate, None,
                          loss, params, optax.sgd(0.1), fsdp=False)
    [kernel] = [pl for pl in trainer.plan.placements if pl.path[:2] == ("Dense_0", "kernel")]
    assert not kernel.reason.startswith("annotation")


def test_an_annotation_that_does_not_divide_names_the_parameter_and_the_fix():
    from redcoast.errors import ConfigError
    model, params = linen_mlp_params((None, "model"))  # 16 outputs over 4 shards: fine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(Deployer(jax_seed=0, n_model_shards=4, verbose=False), collate, None,
                lambda *a: 0.0, params, optax.sgd(0.1), fsdp=False)
    model, params = linen_mlp_params(("model", None))  # 4 inputs over 4 shards divide; 8 would not
    with pytest.raises(ConfigError, match=r"Dense_0/kernel.*into 8 parts, which does not divide"):
        Trainer(Deployer(jax_seed=0, n_model_shards=8, verbose=False), collate, None,
                lambda *a: 0.0, params, optax.sgd(0.1), fsdp=False)
