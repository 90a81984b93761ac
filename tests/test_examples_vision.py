"""The vision examples (CNN classifier, DP-SGD, image captioning) run as a user runs them, in their
tiny mode, and learn: each is scored against a baseline measured in the same run."""

import pytest

from example_runner import run_example


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
