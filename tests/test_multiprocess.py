"""Several real processes on loopback (jax.distributed, gloo) give the single-process results.

Two layouts of 8 CPU devices against one process with all 8, with 1, 2 and 4 model shards:
2 processes x 4 devices started by ``redcoast launch`` (the script finds its place from the
environment), and 4 processes x 2 devices given explicit Deployer arguments.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import multiprocess_worker
import run_tiny
import tiny_lm
from redcoast import Deployer
from redcoast.store.checkpoint import CheckpointStore
from tiny_lm import make_examples

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multiprocess_worker.py")
DEVICES = 8


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env():
    """The test's environment (with conftest's XLA flags) less its forced device count."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    root = os.path.dirname(HERE)  # this checkout's redcoast, whatever is installed
    env["PYTHONPATH"] = os.pathsep.join([root, HERE, env.get("PYTHONPATH", "")])
    return env


def launch_worker(out_dir, mode, timeout):
    """multiprocess_worker.py in ``mode`` on 2 processes x 4 devices by ``redcoast launch``;
    fails with the end of their output unless both succeed."""
    cmd = [sys.executable, "-m", "redcoast.cli.launch_command", "-n", "2", "--local-devices", "4", WORKER,
           str(out_dir), mode]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


def load_results(out_dir, n_processes, shard_counts):
    return {mp: [dict(np.load(os.path.join(out_dir, f"process_{i}_mp{mp}.npz")))
                 for i in range(n_processes)] for mp in shard_counts}


@pytest.fixture(scope="module")
def single_process():
    """``get(n_model_shards)``: the results of one process with 8 devices (computed once each),
    with the number of example rows it collated."""
    cache = {}

    def get(mp):
        if mp not in cache:
            collated = []
            collate = run_tiny.collate_fn
            run_tiny.collate_fn = lambda examples: (collated.append(len(examples)),
                                                    collate(examples))[1]
            try:
                cache[mp] = run_tiny.run(Deployer(jax_seed=0, n_model_shards=mp, verbose=False))
            finally:
                run_tiny.collate_fn = collate
            cache[mp]["rows_collated"] = sum(collated)
        return cache[mp]

    return get


def check_same_results(results, single_process, n_processes):
    for mp, per_process in results.items():
        expected = single_process(mp)
        for i, result in enumerate(per_process):
            where = f"process {i} of {n_processes}, n_model_shards={mp}"
            assert int(result["n_processes"]) == n_processes
            assert int(result["process_index"]) == i
            # Every process holds the complete, ordered predictions.
            np.testing.assert_array_equal(result["predictions"], expected["predictions"],
                                          err_msg=where)
            assert float(result["eval_loss"]) == pytest.approx(
                float(expected["eval_loss"]), rel=1e-5), where
            for key, value in expected.items():
                if key.startswith("param:"):
                    np.testing.assert_allclose(result[key], value, rtol=1e-5, atol=1e-6,
                                               err_msg=f"{key} ({where})")
            # Each process collated only the rows its own devices hold: 1/n of every batch, or
            # more when one model copy spans several processes (they hold the same rows).
            sharing = max(1, mp * n_processes // DEVICES)
            assert int(result["rows_collated"]) * n_processes == \
                expected["rows_collated"] * sharing, where


# Each layout runs in one set of processes, one n_model_shards after the other; the quick set
# covers both layouts and all three shard counts between them.
LAYOUTS = [
    pytest.param("launch", (2,), id="launch-2x4-mp2"),
    pytest.param("launch", (1, 4), id="launch-2x4-mp1,4", marks=pytest.mark.slow),
    # mp=1 on four processes: launch-2x4-mp1,4 covers it (193 s with it, about half without);
    # mp=2, one model copy inside each process as in launch-2x4-mp2, too (86 s with it). mp=4:
    # each model copy spans two of the four processes
    pytest.param("explicit", (4,), id="explicit-4x2-mp4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("how, shard_counts", LAYOUTS)
def test_several_processes_match_one(tmp_path, single_process, how, shard_counts):
    if how == "launch":
        results = run_launched(tmp_path, 2, 4, shard_counts)
    else:
        results = run_explicit(tmp_path, 4, 2, shard_counts)
    check_same_results(results, single_process, DEVICES // (4 if how == "launch" else 2))


def run_launched(out_dir, n, n_local, shard_counts):
    """`redcoast launch -n 2 --local-devices 4`: unchanged script, logs from process 0 only."""
    cmd = [sys.executable, "-m", "redcoast.cli.launch_command", "-n", str(n), "--local-devices", str(n_local),
           WORKER, str(out_dir), ",".join(map(str, shard_counts))]
    env = child_env()
    env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"  # the launcher strips it
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    lines = output.splitlines()
    assert any(line.startswith("[0] ") and "redcoast]" in line for line in lines), output[-3000:]
    # Only process 0 logs (console, progress bars); the others print nothing of their own
    # but their last word (gloo's connection notes, from C++ threads, are not redcoast's).
    for i in range(1, n):
        said = [line for line in lines if line.startswith(f"[{i}] ")]
        assert f"[{i}] worker {i} finished" in said, said
        assert not [line for line in said if "redcoast]" in line or "%|" in line or "epoch" in line]
    for mp in shard_counts:  # one writer of each run's files
        with open(os.path.join(out_dir, f"workdir_mp{mp}", "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        assert sum(r.get("event") == "run_start" for r in records) == 1
    return load_results(out_dir, n, shard_counts)


def run_explicit(out_dir, n, n_local, shard_counts):
    """Processes started by hand, each given explicit Deployer arguments."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, WORKER, str(out_dir), ",".join(map(str, shard_counts)), str(i), str(n),
         str(port), str(n_local)], env=child_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(n)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=500)[0])
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    return load_results(out_dir, n, shard_counts)


@pytest.mark.slow  # 31 s: four processes, then two, then one
def test_checkpoints_move_between_process_counts(tmp_path):
    """Saved by 1 process -> restored and continued by 2 -> saved by 2 -> restored by 1."""
    one = multiprocess_worker.ckpt_trainer(str(tmp_path / "one"))
    one.fit(make_examples(multiprocess_worker.CKPT_EXAMPLES), 1, n_epochs=1, save_last_ckpt=True)
    saved_by_one = multiprocess_worker.host_state(one)
    shutil.copytree(tmp_path / "one" / "checkpoints", tmp_path / "two" / "workdir" / "checkpoints")
    launch_worker(str(tmp_path / "two"), "ckpt", timeout=500)
    for i in range(2):
        restored = dict(np.load(tmp_path / "two" / f"restored_{i}.npz"))
        assert sorted(restored) == sorted(saved_by_one)
        for key, value in saved_by_one.items():  # bitwise: a restore is a copy
            np.testing.assert_array_equal(restored[key], value, err_msg=f"process {i}: {key}")
    final = dict(np.load(tmp_path / "two" / "final_0.npz"))
    assert int(final["step"]) == 2 * int(saved_by_one["step"])  # it continued, not restarted
    back = multiprocess_worker.ckpt_trainer(str(tmp_path / "back"))
    meta = back.restore_checkpoint(CheckpointStore(tmp_path / "two" / "workdir" / "checkpoints" / "steps"))
    assert meta["step"] == int(final["step"])
    for key, value in multiprocess_worker.host_state(back).items():
        np.testing.assert_array_equal(value, final[key], err_msg=key)


@pytest.mark.slow
def test_kv_heads_kept_by_groups_train_alike_on_two_processes(tmp_path):
    # K/V split over groups of the model shards ('mp:2' on a view of the mesh): 2 processes x 4
    # devices train the same parameters as one process with 8
    one = multiprocess_worker.grouped_kv_run(str(tmp_path))
    assert str(one["k_spec"]) == str(P(None, "mp:2"))
    os.makedirs(tmp_path / "two")
    launch_worker(str(tmp_path / "two"), "gqa", timeout=500)
    for i in range(2):
        two = dict(np.load(tmp_path / "two" / f"gqa_{i}.npz"))
        assert str(two["k_spec"]) == str(one["k_spec"])
        for key, value in one.items():
            if key != "k_spec":
                np.testing.assert_allclose(two[key], value, rtol=1e-5, atol=1e-6, err_msg=f"process {i}: {key}")


@pytest.mark.slow
def test_a_nan_loss_at_step_0_is_explained_on_every_process(tmp_path):
    # the first batch and the parameters are read across the processes (each holds its part)
    launch_worker(str(tmp_path), "nan", timeout=300)
    for i in range(2):
        message = (tmp_path / f"nan_{i}.txt").read_text()
        assert "at step 0" in message and "learning rate is not the cause" in message, message
        assert "batch['labels'] holds negative values (the smallest -100" in message, message


@pytest.mark.slow
def test_moving_arrays_that_span_processes_never_deadlocks(tmp_path):
    # with jax.device_put this test failed 3 of 3 runs on jax 0.10.2 (its per-array programs ran in
    # other orders on the two processes); placement.device_put moves them in one order on both
    launch_worker(str(tmp_path), "moves", timeout=90)
    for i in range(2):
        moved = dict(np.load(tmp_path / f"moves_{i}.npz"))
        assert len(moved) == 40
        for name, values in moved.items():
            i_array = int(name[1:])
            expected = np.arange(values.size, dtype=np.float32).reshape(-1, 16) + i_array
            np.testing.assert_array_equal(values, expected, err_msg=f"process {i}: {name}")


@pytest.mark.slow
def test_merging_lora_adapters_that_span_processes_outside_the_step(tmp_path):
    # op by op, lora.merge's per-kernel programs (their collectives gather the FSDP-sharded
    # adapters across processes) hung 5 of 5 runs on jax 0.10.2; it now runs as one program
    launch_worker(str(tmp_path), "merge", timeout=120)
    for i in range(2):
        got = dict(np.load(tmp_path / f"merge_{i}.npz"))
        kernels = [k[len("['merged']"):] for k in got
                   if k.startswith("['merged']") and k.endswith("['kernel']")]
        assert len(kernels) == 13  # 2 blocks x 6 matmuls + the head: every one adapted
        for path in kernels:
            a, b = (got[f"['adapters']{path}['lora_{x}']"] for x in ("a", "b"))
            expected = got[f"['base']{path}"] + 2.0 * a @ b  # alpha / rank = 8 / 4
            np.testing.assert_allclose(got[f"['merged']{path}"], expected, rtol=1e-6, atol=1e-6,
                                       err_msg=f"process {i}: {path}")
            assert got[f"spec['merged']{path}"] == got[f"spec['base']{path}"], path
        for name in got:  # what was not adapted is the base itself
            if name.startswith("['merged']") and not name.endswith("['kernel']"):
                np.testing.assert_array_equal(got[name], got["['base']" + name[len("['merged']"):]])


@pytest.mark.slow
def test_a_host_far_ahead_of_the_devices_never_deadlocks(tmp_path):
    # 200 updates read once, and evaluations of 40 batches read at their end: with every step
    # left in flight, two processes hung 3 of 3 runs on jax 0.10.2 (redcoast/loop/in_flight.py)
    launch_worker(str(tmp_path), "lead", timeout=150)
    runs = [dict(np.load(tmp_path / f"lead_{i}.npz")) for i in range(2)]
    assert int(runs[0]["step"]) == 200
    for name in runs[0]:
        np.testing.assert_array_equal(runs[0][name], runs[1][name], err_msg=name)
    losses = runs[0]["eval_losses"]
    assert np.all(losses == losses[0]), losses
    model, params = tiny_lm.make_model()
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    trained = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params),
                                           [runs[0]["['params']" + p] for p in paths])
    expected = tiny_lm.example_losses(model, trained, tiny_lm.make_examples(160, seed=1)).mean()
    np.testing.assert_allclose(losses[0], expected, rtol=1e-5)
