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
