"""The benchmarks keep running on CPU (their --tiny modes), so they do not rot between runs."""

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_run(script, timeout=600):
    """``benchmarks/<script> --tiny``'s standard output, the script having exited 0."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # it sets its own devices
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--tiny"],
                         capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.slow
def test_gpu_mfu_tiny_runs_and_reports():
    text = tiny_run("gpu_mfu.py")
    for expected in ("candidate: per-device batch 2, remat False", "-> fits", "jax ",
                     "FLOPs per token (6N + 12*L*s*h)", "redcoast Trainer :", "hand-written jit :",
                     "redcoast / hand-written step time:", "attention xla", "its step alone   :",
                     "first update (compile + one step): Trainer"):
        assert expected in text, (expected, text)


@pytest.mark.slow
def test_init_compile_tiny_compiles_both_ways_and_draws_the_same_numbers():
    text = tiny_run("init_compile.py")
    for expected in ("2 layers, redcoast's options: compiled in", "2 layers, without them:",
                     "the same numbers with and without the options: yes"):
        assert expected in text, (expected, text)


@pytest.mark.slow
def test_real_size_tiny_runs_every_program_and_their_losses_agree():
    # B2 (issue 51) shrunk: SmolLM2's and a 1B Llama's shapes at width 64, a mesh each; the
    # script exits non-zero where redcoast's and the hand-written step's eval losses disagree
    text = tiny_run("real_size.py", timeout=900)
    rows = [line.split() for line in text.splitlines() if line.strip().startswith(("2x4", "4x2"))]
    assert [(r[0], r[1]) for r in rows] == [("2x4", "redcoast"), ("2x4", "hand"),
                                           ("4x2", "redcoast"), ("4x2", "hand")], text
    assert all("agree;" in " ".join(r) for r in rows if r[1] == "redcoast"), text
    # each program's matrix-product GFLOP a device (column "dot GF"), read from its compiled step
    assert all(float(r[11]) > 0 for r in rows), text


def test_real_size_says_what_a_hand_step_killed_for_memory_needed(monkeypatch, capsys):
    # the kernel's OOM killer leaves no Python error: the row names the kill and what the hand
    # step's compiled program said it needs a device, printed before it ran
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # undone after the test
    import real_size
    said = real_size.needs_line(3338 * 2**20, 1.54e12)  # what run_hand prints before it runs
    for stdout, expected in ((said + "\n", "; its compiled step needs 3338 MiB a device, 1540 dot "
                              "GFLOP\n"), ("", "most likely out of the host's memory\n")):
        monkeypatch.setattr(real_size.subprocess, "run", lambda argv, stdout=stdout, **kw: (
            subprocess.CompletedProcess(argv, -signal.SIGKILL, stdout=stdout, stderr="")))
        args = SimpleNamespace(shape="llama-1b", seq=2048, batch=8, steps=2, layers=1,
                               tiny=False, hand_xla_defaults=False)
        assert real_size.measure(args, "hand", "4x2", "w", "off", "r") is None
        out = capsys.readouterr().out
        assert "4x2      hand failed: killed (SIGKILL)" in out and out.endswith(expected), out


@pytest.mark.slow
def test_generate_tiny_times_every_row_and_gives_the_hand_loops_tokens():
    # issue 51's generation benchmark shrunk: the bandwidth, decode at batch 1 and every
    # setting against the hand-written loop; it exits non-zero where the tokens differ
    text = tiny_run("generate.py")
    assert "memory bandwidth" in text and "same tokens: yes" in text, text
    rows = [line.split() for line in text.splitlines() if line.startswith(("greedy", "beam2"))]
    assert len(rows) == 6 and all(r[-1] == "yes" for r in rows), text
    decode = [line.split() for line in text.splitlines()
              if line.startswith(("redcoast ", "hand ", "weights alone "))]
    assert [r[0] for r in decode] == ["redcoast", "hand", "weights"], text
    assert all(r[-1].endswith("%") for r in decode) and decode[-1][-1] == "100%", text
