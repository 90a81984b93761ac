"""Several real processes on loopback (jax.distributed, gloo) give the single-process results."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from redcoast import Deployer
from run_tiny import run

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n_processes, n_local_devices, n_model_shards, out_dir, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, os.path.join(HERE, "multiprocess_worker.py"), str(i), str(n_processes),
         str(port), str(n_local_devices), str(n_model_shards), str(out_dir)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(n_processes)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    return [dict(np.load(os.path.join(out_dir, f"process_{i}.npz"))) for i in range(n_processes)]


@pytest.mark.parametrize("n_processes, n_model_shards", [(2, 2), (4, 4)])
def test_several_processes_match_one(tmp_path, n_processes, n_model_shards):
    results = launch(n_processes, 8 // n_processes, n_model_shards, tmp_path)
    expected = run(Deployer(jax_seed=0, n_model_shards=n_model_shards, verbose=False))
    for result in results:  # every process holds the complete, ordered results
        assert int(result["n_processes"]) == n_processes
        np.testing.assert_array_equal(result["predictions"], expected["predictions"])
        assert float(result["eval_loss"]) == pytest.approx(float(expected["eval_loss"]), rel=1e-5)
        for key, value in expected.items():
            if key.startswith("param:"):
                np.testing.assert_allclose(result[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
