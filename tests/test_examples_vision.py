"""The vision examples (CNN classifier, DP-SGD, image captioning) run as a user runs them, in their
tiny mode, and learn: each is scored against a baseline measured in the same run."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from example_runner import ROOT, run_example
from redcoast import Deployer, Trainer


@pytest.mark.examples
def test_image_classification_beats_chance_and_the_untrained_model():
    metrics, _ = run_example("image_classification")
    assert metrics["n_data_shards"] == 8
    assert metrics["untrained_test_accuracy"] < 0.3  # near chance (10%) before training
    assert metrics["test_accuracy"] > 0.8


@pytest.mark.examples
def test_dp_sgd_learns_within_its_privacy_budget():
    metrics, _ = run_example("dp_sgd")
    # the accountant's epsilon for the steps run is the budget asked for, not more
    assert metrics["epsilon"] <= metrics["target_epsilon"] * (1 + 1e-6)
    assert metrics["noise_multiplier"] > 1.0  # real noise: epsilon 4 over ~100 steps needs it
    assert metrics["truncated_examples"] == 0  # every Poisson batch fit its padded size
    assert metrics["untrained_test_accuracy"] < 0.3  # near chance (10%) before training
    assert metrics["test_accuracy"] > 0.6


@pytest.mark.examples
def test_image_to_text_captions_beat_the_untrained_model():
    metrics, _ = run_example("image_to_text")
    assert (metrics["n_model_shards"], metrics["n_data_shards"]) == (2, 4)
    assert metrics["params_split"] > 0  # tensor parallel: some weights are split over 'mp'
    # the untrained model's captions share almost no word with the truth, whole or in place
    assert metrics["untrained_exact_match"] < 0.02 and metrics["untrained_word_accuracy"] < 0.2
    assert metrics["word_accuracy"] > 0.6
    assert metrics["exact_match"] > metrics["untrained_exact_match"] + 0.05


@pytest.mark.examples
def test_dp_sgd_step_clips_each_example_then_averages_over_the_padded_batch():
    """The example's DP step through the Trainer (batch sharded over 8 devices), noise off, equals
    clipping each real example's gradient alone, on one device, and dividing by the batch size."""
    spec = importlib.util.spec_from_file_location("dp_sgd_main", ROOT / "examples/dp_sgd/main.py")
    dp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dp)
    model = nn.Dense(10)  # a linear model on the flattened image: fast to compile
    apply_fn = lambda variables, x: model.apply(variables, x.reshape((x.shape[0], -1)))  # noqa: E731
    rng = np.random.default_rng(0)
    examples = [{"image": rng.random((8, 8, 1), np.float32), "label": int(rng.integers(10))}
                for _ in range(13)] + [dp.PADDING] * 3
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 64)))["params"]
    clip, lr = 0.05, 1.0
    optimizer = optax.chain(optax.contrib.differentially_private_aggregate(
        clip, 0.0, key=jax.random.key(0)), optax.sgd(lr))
    trainer = Trainer(Deployer(jax_seed=0, verbose=False), dp.collate_fn, apply_fn, dp.loss_fn,
                      params, optimizer, train_step_fn=dp.dp_train_step)
    trainer.train(examples, per_device_batch_size=2, shuffle=False)

    def grad_of(example):  # one real example, on its own
        batch = dp.collate_fn([example])
        state = type("S", (), {"apply_fn": staticmethod(apply_fn)})
        return jax.grad(lambda p: dp.loss_fn(None, state, p, batch, True)[0])(params)

    total = jax.tree_util.tree_map(jnp.zeros_like, params)
    for example in examples[:13]:
        g = grad_of(example)
        norm = float(optax.tree.norm(g))
        assert norm > clip  # so that clipping matters in this check
        total = jax.tree_util.tree_map(lambda t, x: t + x * clip / norm, total, g)
    expected = jax.tree_util.tree_map(lambda p, t: p - lr * t / len(examples), params, total)
    for got, want in zip(jax.tree_util.tree_leaves(trainer.params), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
