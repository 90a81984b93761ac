"""The MAML, FedAvg, PPO and DDPG examples learn in their --tiny runs (against baselines that
each run computes itself), and Trainer.set_params, which FedAvg and DDPG need, keeps the
compiled step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from example_runner import run_example


@pytest.mark.examples
def test_maml_adapts_better_than_before_meta_training():
    metrics, _ = run_example("meta_learning")
    assert metrics["query_mse_after"] < 0.5 * metrics["query_mse_before"], metrics
    # and better than the trivial answer (the waves' mean, 0), which adaptation alone misses
    assert metrics["query_mse_after"] < 0.8 * metrics["query_mse_zero"], metrics


@pytest.mark.examples
def test_fedavg_global_model_beats_one_client_alone():
    metrics, _ = run_example("federated_learning")
    assert metrics["test_acc_fedavg"] > 0.6, metrics  # 10 classes: chance is 0.1
    assert metrics["test_acc_fedavg"] > metrics["test_acc_single_client"] + 0.25, metrics
    assert metrics["test_acc_fedavg"] > metrics["test_acc_initial"] + 0.4, metrics


@pytest.mark.examples
def test_ppo_return_rises_far_above_random():
    metrics, _ = run_example("ppo")
    assert metrics["return_trained"] > 100, metrics
    assert metrics["return_trained"] > 4 * metrics["return_random"], metrics
    assert metrics["return_trained"] > 4 * metrics["return_first_iteration"], metrics


@pytest.mark.examples
def test_ddpg_return_rises_above_random_and_untrained():
    metrics, _ = run_example("ddpg")
    # Pendulum's returns are negative (0 best); random policies score about -1200
    assert metrics["return_trained"] > metrics["return_random"] + 400, metrics
    assert metrics["return_trained"] > metrics["return_untrained"] + 400, metrics


def _linear_trainer():
    from redcoast import Deployer, Trainer

    def loss_fn(rng, state, params, batch, is_training):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)
    params = {"w": jnp.zeros((4, 2))}
    return Trainer(deployer=deployer, collate_fn=lambda ex: {k: np.stack([e[k] for e in ex])
                                                              for k in ex[0]},
                   apply_fn=None, loss_fn=loss_fn, params=params, optimizer=optax.adam(0.1))


def test_set_params_replaces_params_and_optimizer_state_without_recompiling():
    rng = np.random.default_rng(0)
    examples = [{"x": rng.normal(size=4).astype(np.float32),
                 "y": rng.normal(size=2).astype(np.float32)} for _ in range(64)]
    trainer = _linear_trainer()
    trainer.train(examples, per_device_batch_size=4)
    compiled = trainer.layout.train_step._cache_size()
    new = {"w": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)}
    trainer.set_params(new)
    np.testing.assert_array_equal(np.asarray(trainer.params["w"]), np.asarray(new["w"]))
    fresh = optax.adam(0.1).init(new)
    for got, want in zip(jax.tree_util.tree_leaves(trainer.state.opt_state),
                         jax.tree_util.tree_leaves(fresh)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    trainer.train(examples, per_device_batch_size=4, epoch=1)
    assert trainer.layout.train_step._cache_size() == compiled  # the same compiled step
    assert np.asarray(new["w"]).shape == (4, 2)  # the caller's arrays were not donated
    kept = jax.tree_util.tree_map(np.asarray, trainer.state.opt_state)
    trainer.set_params(trainer.params, reset_opt_state=False)
    for got, want in zip(jax.tree_util.tree_leaves(trainer.state.opt_state),
                         jax.tree_util.tree_leaves(kept)):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_set_params_of_another_shape_is_refused():
    from redcoast import ConfigError
    trainer = _linear_trainer()
    with pytest.raises(ConfigError, match="shaped like trainer.params"):
        trainer.set_params({"w": jnp.zeros((4, 3))})


def test_set_params_accepts_arrays_on_another_mesh():
    """The constructor places arrays from anywhere; set_params does too."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    trainer = _linear_trainer()  # 4 x 2 mesh
    other = jax.make_mesh((2, 4), ("x", "y"))
    new = {"w": jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(other, P("y")))}
    on_one = {"w": jax.device_put(jnp.ones((4, 2)), jax.devices()[3])}
    trainer.set_params(new)
    np.testing.assert_array_equal(np.asarray(trainer.params["w"]), np.arange(8.0).reshape(4, 2))
    assert trainer.params["w"].sharding.mesh.shape == {"dp": 4, "mp": 2}
    trainer.set_params(on_one)
    np.testing.assert_array_equal(np.asarray(trainer.params["w"]), np.ones((4, 2)))
