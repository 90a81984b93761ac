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
