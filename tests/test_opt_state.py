"""Optimizer state is sharded like the parameters it belongs to, for any optimizer."""

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
