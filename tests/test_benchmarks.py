"""The GPU benchmark keeps running on CPU (its --tiny mode), so it does not rot between GPU runs."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_mfu_tiny_runs_and_reports():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # it sets its own devices
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_mfu.py"), "--tiny"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    for expected in ("candidate: per-device batch 2, remat False", "-> fits", "jax ",
                     "FLOPs per token (6N + 12*L*s*h)", "redcoast Trainer :", "hand-written jit :",
                     "redcoast / hand-written step time:", "attention xla"):
        assert expected in text, (expected, text)
