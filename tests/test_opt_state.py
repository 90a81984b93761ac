"""Optimizer state is sharded like the parameters it belongs to, for any optimizer."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from redcoast import Deployer, Trainer
from redcoast.sharding.opt_state import state_leaf_spec


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.relu(nn.Dense(64)(nn.relu(nn.Dense(16)(x)))))


def collate(examples):
    return {"x": np.stack([e[0] for e in examples]), "y": np.stack([e[1] for e in examples])}


def loss(rng, state, params, batch, is_training):
    return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)


OPTIMIZERS = {
    "adamw": optax.adamw(1e-3),
    "adafactor": optax.adafactor(1e-3, min_dim_size_to_factor=8),
    "sgd_momentum": optax.sgd(1e-2, momentum=0.9),
    "lion": optax.lion(1e-4),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_is_sharded_and_training_matches_one_device(name):
    tx = OPTIMIZERS[name]
    model = MLP()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16)))["params"]
    rs = np.random.RandomState(0)
    examples = [(rs.randn(16).astype(np.float32), rs.randn(16).astype(np.float32)) for _ in range(32)]

    trainer = Trainer(Deployer(n_model_shards=4, verbose=False), collate, model.apply, loss, params, tx)
    trainer.fit(examples, 4, 1, shuffle=False)  # 2 data shards x 4 = 8 per step, 4 steps

    kernel_spec = trainer.params["Dense_1"]["kernel"].sharding.spec
    # Dense_0 reads the replicated input (column-parallel), so Dense_1 (16, 64) reads a split
    # activation: row-parallel over its 16 inputs
    assert kernel_spec == P("mp")
    for path, leaf in jax.tree_util.tree_leaves_with_path(trainer.state.opt_state):
        keys = jax.tree_util.keystr(path)
        if "Dense_1" in keys and "kernel" in keys and leaf.shape == (16, 64):
            assert leaf.sharding.spec == kernel_spec, keys

    # the same updates on one device, by hand
    import types
    state = types.SimpleNamespace(apply_fn=model.apply)
    opt_state = tx.init(params)
    step = jax.jit(lambda p, o, b: _update(tx, state, p, o, b))
    for i in range(4):
        params, opt_state = step(params, opt_state, collate(examples[i * 8:(i + 1) * 8]))
    for a, b in zip(jax.tree_util.tree_leaves(trainer.params), jax.tree_util.tree_leaves(params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _update(tx, state, params, opt_state, batch):
    grads = jax.grad(lambda p: loss(None, state, p, batch, True))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def test_state_leaf_spec_matches_by_path_and_shape():
    by_path = {("params", "w"): ((64, 16), P("mp", None))}
    assert state_leaf_spec(("0", "mu", "params", "w"), (64, 16), by_path) == P("mp", None)
    assert state_leaf_spec(("0", "v_row", "params", "w"), (64,), by_path) == P("mp")
    assert state_leaf_spec(("0", "v_col", "params", "w"), (16,), by_path) == P(None)
    assert state_leaf_spec(("0", "count"), (), by_path) == P()
    assert state_leaf_spec(("0", "v", "params", "w"), (1,), by_path) == P()
    square = {("w",): ((8, 8), P(None, "mp"))}
    assert state_leaf_spec(("v_row", "w"), (8,), square) == P()  # ambiguous: replicated


def _mlp_trainer(tx):
    model = MLP()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16)))["params"]
    trainer = Trainer(Deployer(n_model_shards=4, verbose=False), collate, model.apply, loss,
                      params, tx)
    batch = collate([(np.ones(16, np.float32), np.zeros(16, np.float32))] * 8)
    return trainer, params, batch


def _specs(tree):
    return [x.sharding.spec for x in jax.tree_util.tree_leaves(tree)]


def test_an_optimizer_state_given_before_the_first_batch_is_moved_not_made_again():
    # a fresh optimizer state is made again on the chosen layout (cheaper than moving it);
    # one given by restart(opt_state=...) must arrive there as it was
    tx = optax.adam(1e-3)
    trainer, params, batch = _mlp_trainer(tx)
    given = jax.tree_util.tree_map(
        lambda x: x + (3 if jnp.issubdtype(x.dtype, jnp.integer) else 0.25), tx.init(params))
    trainer.restart(opt_state=given)
    before = _specs(trainer.state.opt_state)
    trainer.compile_train_step(batch)
    assert _specs(trainer.state.opt_state) != before  # the layout changed: the state moved
    for got, want in zip(jax.tree_util.tree_leaves(trainer.state.opt_state),
                         jax.tree_util.tree_leaves(given)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    fresh, params, batch = _mlp_trainer(tx)
    fresh.compile_train_step(batch)
    for got, want in zip(jax.tree_util.tree_leaves(fresh.state.opt_state),
                         jax.tree_util.tree_leaves(tx.init(params))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert _specs(fresh.state.opt_state) == _specs(trainer.state.opt_state)


def test_an_optimizer_state_holding_the_parameters_keeps_them_when_made_again():
    # e.g. lookahead's slow copy, schedule-free's z: the state made again on the chosen layout
    # holds the moved parameters' values, and the parameters survive the old state's freeing
    # (jax 0.10-0.12 never return a jitted init's input as its output, so the freeing's guard
    # for that case is not reached here: this checks the values)
    def init(params):
        return {"start": params, "count": jnp.zeros((), jnp.int32)}

    def update(grads, state, params=None):
        updates = jax.tree_util.tree_map(lambda g, p, s: -0.1 * g + 0.01 * (s - p),
                                         grads, params, state["start"])
        return updates, {"start": state["start"], "count": state["count"] + 1}

    trainer, params, batch = _mlp_trainer(optax.GradientTransformation(init, update))
    trainer.compile_train_step(batch)
    for got, want in zip(jax.tree_util.tree_leaves(trainer.state.opt_state["start"]),
                         jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for got, want in zip(jax.tree_util.tree_leaves(trainer.params),
                         jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_moving_the_state_to_the_chosen_layout_donates_only_what_xla_can_reuse():
    # the move from the construction-time layout donated every array; XLA can reuse no buffer
    # whose pieces change shape, and JAX warned so ("Some donated buffers were not usable") on
    # every run with model shards. Those are now deleted after the move instead: as freed.
    trainer, params, batch = _mlp_trainer(optax.adam(1e-3))
    before = jax.tree_util.tree_leaves(trainer.state.params)
    pieces = [x.sharding.shard_shape(x.shape) for x in before]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Some donated buffers")
        trainer.compile_train_step(batch)
    after = jax.tree_util.tree_leaves(trainer.state.params)
    moved = [a.sharding.shard_shape(a.shape) != p for a, p in zip(after, pieces)]
    assert any(moved) and not all(moved), pieces  # some arrays donated, some not
    assert all(x.is_deleted() for x in before)
    for got, want in zip(after, jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
