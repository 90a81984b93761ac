"""Fault trials: each fault is either survived (checked against an independent answer) or stopped
early with a redcoast error naming the cause and the fix. Tiny models, a few steps each."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import weakref

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from redcoast import (CheckpointError, ConfigError, Deployer, EvaluationError, LossError,
                      NonFiniteLossError, Trainer)
from redcoast.store.checkpoint import CheckpointStore
from redcoast.store.workdir import LOCK_NAME, STALE_AFTER_S, WorkdirLock, absolute

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
W_TRUE = np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)


def examples(n=32, seed=0):
    x = np.random.RandomState(seed).normal(size=(n, 4)).astype(np.float32)
    return [{"x": xi, "y": xi @ W_TRUE[:, 0]} for xi in x]


def collate(rows):
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def mse(rng, state, params, batch, is_training):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred[:, 0] - batch["y"]) ** 2)


def linear_trainer(workdir=None, lr=0.1, loss=mse, rules=None, optimizer=None):
    """A linear regression on 8 devices: 32 examples, batch 8, 4 updates per epoch."""
    deployer = Deployer(jax_seed=0, workdir=None if workdir is None else str(workdir), verbose=False)
    params = {"w": np.zeros((4, 1), np.float32), "b": np.zeros((1,), np.float32)}
    return Trainer(deployer, collate, None, loss, params, optimizer or optax.sgd(lr),
                   params_sharding_rules=rules)


def host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def assert_trees_equal(a, b):
    jax.tree_util.tree_map(np.testing.assert_array_equal, host(a), host(b))


def restored_params(workdir, like_trainer):
    store = CheckpointStore(os.path.join(workdir, "checkpoints", "steps"))
    meta = like_trainer.restore_checkpoint(store)
    store.close()
    return meta, host(like_trainer.params)


# -- 1. resume=False never loses the new run; no save is skipped; one run per workdir ----------

def test_resume_false_moves_the_earlier_run_aside_and_saves_the_new_one(tmp_path):
    earlier = linear_trainer(tmp_path, lr=0.1)
    earlier.fit(examples(), 1, 1, save_last_ckpt=True)
    new = linear_trainer(tmp_path, lr=0.02)
    new.fit(examples(), 1, 1, save_last_ckpt=True, resume=False)
    meta, params = restored_params(tmp_path, linear_trainer())
    assert meta["step"] == 4
    assert_trees_equal(params, new.params)  # the new run's, not the earlier one's
    assert not np.allclose(params["w"], host(earlier.params)["w"])
    aside = [n for n in os.listdir(tmp_path) if n.startswith("checkpoints.earlier-run-")]
    assert len(aside) == 1 and os.listdir(tmp_path / aside[0] / "steps") == ["4"]
    log = (tmp_path / "log.txt").read_text()
    assert "resume=False: the checkpoints of an earlier run" in log and aside[0] in log


def test_a_step_on_disk_from_another_run_is_never_silently_kept(tmp_path):
    state = {"w": jnp.ones(3)}
    first = CheckpointStore(tmp_path, async_save=False)
    first.save(7, state, {"run": "first"})
    first.close()
    second = CheckpointStore(tmp_path, async_save=False)
    with pytest.raises(CheckpointError, match=r"Cannot save step 7: .*7 already holds a "
                                              r"checkpoint that this run did not write.*Fix"):
        second.save(7, {"w": jnp.zeros(3)}, {"run": "second"})
    second.close()


def test_a_workdir_in_use_by_a_live_run_is_refused_and_a_stale_lock_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"host": socket.gethostname(), "pid": holder.pid, "started": time.time()}
        (tmp_path / LOCK_NAME).write_text(json.dumps(lock))
        (tmp_path / "log.txt").write_text("the holder's log\n")
        with pytest.raises(CheckpointError, match=rf"in use by another run \(process {holder.pid} "
                                                  r"on host .*Fix: wait for that run") as refused:
            linear_trainer(tmp_path).fit(examples(), 1, 1, save_last_ckpt=True)
        assert not (tmp_path / "checkpoints").exists()  # refused before any work
        # refused by the Deployer, before a line of this run went into the holder's log
        assert (tmp_path / "log.txt").read_text() == "the holder's log\n"
        assert not (tmp_path / "metrics.jsonl").exists()
        # the holder is alive here: deleting its lock would let a second run destroy its files
        assert "Do not delete the lock while that process runs" in str(refused.value)
        assert f"delete {tmp_path / LOCK_NAME}" not in str(refused.value)
    finally:
        holder.kill()
        holder.wait()
    trainer = linear_trainer(tmp_path)  # the holder is gone: its lock is stale
    trainer.fit(examples(), 1, 1, save_last_ckpt=True)
    assert f"left by process {holder.pid}" in (tmp_path / "log.txt").read_text()
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end
    assert os.listdir(tmp_path / "checkpoints" / "steps") == ["4"]


def test_a_lock_whose_pid_now_names_another_process_is_taken_over(tmp_path):
    """After a container restart the holder's pid may be a new, unrelated process."""
    lock = {"host": socket.gethostname(), "started": time.time() - 3600}
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_NAME).write_text(json.dumps({**lock, "pid": other.pid}))
        log = []
        taken = WorkdirLock(tmp_path, logger=None)
        taken._warn = log.append
        taken.acquire()
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert f"left by process {other.pid}" in log[0] and "now another process's" in log[0]
        taken.release()
    finally:
        other.kill()
        other.wait()


def test_an_empty_lock_left_by_a_crash_is_taken_over_and_a_fresh_one_waited_for(tmp_path):
    path = tmp_path / LOCK_NAME
    path.write_text("")
    with pytest.raises(CheckpointError, match=r"is being written.*Fix: start one run at a time"):
        WorkdirLock(tmp_path).acquire()  # fresh: perhaps another run is writing it right now
    os.utime(path, (time.time() - 60, time.time() - 60))  # left there a minute ago
    log = []
    lock = WorkdirLock(tmp_path, logger=None)
    lock._warn = log.append
    lock.acquire()
    assert "empty or unreadable" in log[0]
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()


def test_a_lock_from_another_host_is_refused_while_alive_and_taken_over_when_silent(tmp_path):
    def lock_from_elsewhere(silent_s):
        record = {"host": "elsewhere", "pid": 1, "started": time.time() - 1e4,
                  "alive": time.time() - silent_s}
        (tmp_path / LOCK_NAME).write_text(json.dumps(record))

    lock_from_elsewhere(silent_s=5)
    with pytest.raises(CheckpointError, match=r"in use by another run \(process 1 on host "
                                              r"elsewhere.*last sign of life 5 s ago"):
        WorkdirLock(tmp_path).acquire()
    lock_from_elsewhere(silent_s=STALE_AFTER_S + 60)  # its machines were preempted
    lock = WorkdirLock(tmp_path, logger=None).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


# -- 2. restores that fail are reported as what they are ----------------------------------------

def test_an_nnx_module_as_params_restores(tmp_path):
    from flax import nnx

    class Net(nnx.Module):  # a list of layers: int and str keys side by side in its pytree
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(4, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs)])

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    def loss(rng, state, module, batch, is_training):
        return jnp.mean((module(batch["x"])[:, 0] - batch["y"]) ** 2)

    def trainer():
        deployer = Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False)
        return Trainer(deployer, collate, None, loss, Net(nnx.Rngs(0)), optax.adam(1e-2))

    saver = trainer()
    saver.fit(examples(), 1, 1, save_last_ckpt=True)
    restorer = trainer()
    store = CheckpointStore(tmp_path / "checkpoints" / "steps")
    meta = restorer.restore_checkpoint(store)
    store.close()
    assert meta is not None and restorer.step == 4
    assert_trees_equal(nnx.state(restorer.params), nnx.state(saver.params))
    assert_trees_equal(restorer.state.opt_state, saver.state.opt_state)


def truncate_files(directory):
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "r+b") as f:
                f.truncate(0)


def test_a_damaged_checkpoint_is_moved_aside_when_its_step_is_saved_again(tmp_path):
    uninterrupted = linear_trainer(tmp_path)
    uninterrupted.fit(examples(), 1, 1, save_every_n_steps=2)  # steps 2 and 4
    steps = tmp_path / "checkpoints" / "steps"
    truncate_files(steps / "4")
    again = linear_trainer(tmp_path)
    again.fit(examples(), 1, 1, save_every_n_steps=2)  # resumes from 2, saves 4 anew
    assert_trees_equal(again.params, uninterrupted.params)
    assert [n for n in os.listdir(steps) if n.startswith("4.damaged-")]
    meta, params = restored_params(tmp_path, linear_trainer())
    assert meta["step"] == 4
    assert_trees_equal(params, uninterrupted.params)
    assert "moved the damaged checkpoint" in (tmp_path / "log.txt").read_text()


def test_checkpoints_that_exist_but_none_restores_stop_fit(tmp_path):
    linear_trainer(tmp_path).fit(examples(), 1, 1, save_every_n_steps=2)  # steps 2 and 4
    truncate_files(tmp_path / "checkpoints" / "steps")
    trainer = linear_trainer(tmp_path)
    with pytest.raises(CheckpointError, match=r"(?s)None of the 2 checkpoint\(s\) in .* restores:"
                                              r".*/2: is damaged.*/4: is damaged.*Fix: resume=False"):
        trainer.fit(examples(), 1, 1, save_every_n_steps=2)
    assert trainer.step == 0


# -- 3. keep_last_n_ckpts never deletes every checkpoint -----------------------------------------

@pytest.mark.parametrize("keep", [0, -1])
def test_keep_last_n_ckpts_below_one_is_refused(tmp_path, keep):
    trainer = linear_trainer(tmp_path)
    with pytest.raises(ConfigError, match=rf"keep_last_n_ckpts={keep} would keep no checkpoint.*Fix"):
        trainer.fit(examples(), 1, 1, save_every_n_steps=1, keep_last_n_ckpts=keep)
    assert trainer.step == 0 and not (tmp_path / "checkpoints").exists()


# -- 4. after a NaN loss the parameters in memory are the last finite ones ------------------------

def test_after_a_nan_loss_params_are_the_last_finite_ones(tmp_path):
    def nan_from_step_two(rng, state, params, batch, is_training):  # NaN gradients too
        return mse(rng, state, params, batch, is_training) * jnp.where(state.step >= 2, jnp.nan, 1.0)

    adamw = optax.adamw(0.1, weight_decay=0.1)  # momentum and decay: updates even at zero gradient
    trainer = linear_trainer(tmp_path, loss=nan_from_step_two, optimizer=adamw)
    with pytest.raises(NonFiniteLossError, match="at step 2"):
        trainer.fit(examples(), 1, 1, save_every_n_steps=2, log_every_n_steps=100)
    finite = linear_trainer(optimizer=adamw)  # the same run with a finite loss, stopped after 2
    finite.train(examples(), 1, after_step=lambda position: position == 2)
    assert_trees_equal(trainer.params, finite.params)
    meta, saved = restored_params(tmp_path, linear_trainer(optimizer=adamw))
    assert meta["step"] == 2
    assert_trees_equal(saved, finite.params)


# -- 5. redcoast launch: hangs, early exits and busy ports end the launch, naming the culprit ----

def launch(args, tmp_path, script, timeout=60):
    (tmp_path / "job.py").write_text(textwrap.dedent(script))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "redcoast.cli.launch_command", *args, str(tmp_path / "job.py")],
                          env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_launch_a_hung_process_is_named(tmp_path):
    start = time.monotonic()
    code, out = launch(["-n", "2", "--stall-timeout", "2"], tmp_path, """
        import os, time
        i = int(os.environ["REDCOAST_PROCESS_ID"])
        print(f"process {i} starts", flush=True)
        if i == 0:
            time.sleep(0.5)
            print("process 0 waits for its peer", flush=True)
        time.sleep(120)  # process 1 hangs before ever answering
    """)
    assert time.monotonic() - start < 60
    assert code == 1, out
    assert "FAILED: process 1 of 2" in out and "made no progress" in out
    assert "Fix: find where process 1 waits" in out


@pytest.mark.slow  # 20 s: a silent evaluation and prediction, each longer than the stall timeout
def test_launch_a_healthy_silent_evaluation_and_prediction_are_not_taken_for_a_hang(tmp_path):
    # each batch's collate_fn sleeps: 6 batches x 1 s = 6 s without a line of output, over
    # --stall-timeout 4; the loops touch the heartbeat every batch, so the launch completes
    code, out = launch(["-n", "1", "--stall-timeout", "4"], tmp_path, """
        print("importing", flush=True)
        import time
        import numpy as np, optax, jax.numpy as jnp
        print("importing redcoast", flush=True)
        from redcoast import Deployer, Trainer
        print("imported", flush=True)

        def collate(rows):
            time.sleep(1.0)
            return {"x": np.stack([r["x"] for r in rows])}

        def loss(rng, state, params, batch, is_training):
            return jnp.mean(batch["x"] @ params["w"])

        trainer = Trainer(Deployer(jax_seed=0, verbose=False), collate, None, loss,
                          {"w": np.ones((4,), np.float32)}, optax.sgd(0.1), fsdp=False,
                          fuse_matmuls=False)
        rows = [{"x": np.full(4, i, np.float32)} for i in range(6 * trainer.deployer.global_batch_size(1))]
        print("evaluating", flush=True)
        result = trainer.evaluate(rows, 1)["loss"]
        print("evaluated", result, flush=True)
        predictor = trainer.get_default_predictor(lambda rng, params, batch: batch["x"] @ params["w"])
        predictions = predictor.predict(rows, 1, params=trainer.params)
        print("predicted", len(predictions), flush=True)
    """)
    assert code == 0, out
    assert "evaluated" in out and "predicted" in out and "made no progress" not in out


def test_launch_an_early_exit_0_is_a_failure_named(tmp_path):
    code, out = launch(["-n", "2", "--exit-timeout", "1"], tmp_path, """
        import os, sys, time
        if os.environ["REDCOAST_PROCESS_ID"] == "1":
            print("leaving early", flush=True)
            sys.exit(0)
        time.sleep(120)
    """)
    assert code == 1, out
    assert "FAILED: process 1 of 2" in out and "exited with code 0" in out
    assert "[1] leaving early" in out.split("FAILED")[1]  # its own output in the report


@pytest.mark.slow  # 13 s: two jax.distributed processes
def test_launch_a_script_returning_early_under_jax_distributed_is_named(tmp_path):
    """Process 1 leaves right after Deployer(...): JAX's exit handler then holds it alive in the
    shutdown barrier, waiting for process 0 (which waits for it in a collective), so its exit
    status never comes; the launcher is told the script returned and names it after
    --exit-timeout, before Gloo's 30 s deadline would end process 0 and seem to blame it."""
    start = time.monotonic()
    code, out = launch(["-n", "2", "--local-devices", "1", "--exit-timeout", "3"], tmp_path, """
        import sys, time
        from redcoast import Deployer
        deployer = Deployer(verbose=False)
        if deployer.process_index == 1:
            print("leaving early", flush=True)
            sys.exit(0)
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("setup done")  # process 0 waits for process 1
        time.sleep(120)
    """)
    assert code == 1, out
    assert "FAILED: process 1 of 2" in out and "returned from its script" in out, out
    assert "[1] leaving early" in out.split("FAILED")[1]
    assert time.monotonic() - start < 45


def test_launch_a_port_in_use_is_named_before_starting(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out = launch(["-n", "2", "--port", str(port)], tmp_path, "print('started')")
    assert code == 2, out
    assert f"port {port} on 127.0.0.1 (or on another address" in out and "Fix" in out
    assert "started" not in out


def test_launch_a_port_taken_on_another_local_address_or_out_of_range_is_named(tmp_path):
    with socket.socket() as busy:  # the coordinator binds every address: 127.0.0.2 counts
        busy.bind(("127.0.0.2", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out = launch(["-n", "2", "--port", str(port)], tmp_path, "print('started')")
    assert code == 2 and f"port {port} on 127.0.0.1 (or on another address" in out, out
    assert "started" not in out
    code, out = launch(["-n", "2", "--port", "70000"], tmp_path, "print('started')")
    assert code == 2 and "'70000' is not a TCP port: use 1-65535" in out and "Traceback" not in out


def test_launch_a_hung_process_is_named_while_its_peer_keeps_printing(tmp_path):
    code, out = launch(["-n", "2", "--stall-timeout", "2"], tmp_path, """
        import os, time
        if os.environ["REDCOAST_PROCESS_ID"] == "0":
            for _ in range(200):  # a monitoring thread's lines
                print("still here", flush=True)
                time.sleep(0.2)
        time.sleep(120)  # process 1 hangs
    """)
    assert code == 1 and "FAILED: process 1 of 2" in out and "made no progress" in out, out


def test_launch_an_early_exit_then_a_peer_aborted_as_the_last_to_end_blames_the_early_exit(tmp_path):
    code, out = launch(["-n", "2", "--exit-timeout", "30"], tmp_path, """
        import os, sys, time
        if os.environ["REDCOAST_PROCESS_ID"] == "1":
            print("leaving early", flush=True)
            sys.exit(0)
        time.sleep(1.0)
        print("lost my peer", flush=True)
        os.abort()  # what JAX's heartbeat does to the survivor
    """)
    assert code == 1, out
    assert "FAILED: process 1 of 2" in out and "exited with code 0" in out and "a lost peer" in out
    assert "[1] leaving early" in out.split("FAILED")[1]


# -- 6. arguments are checked before any work ------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(per_device_batch_size=0), r"per_device_batch_size=0; it must be a positive integer"),
    (dict(per_device_batch_size=-2), r"per_device_batch_size=-2; it must be a positive integer"),
    (dict(log_every_n_steps=0), r"log_every_n_steps=0; it must be a positive integer"),
    (dict(n_epochs=-1), r"n_epochs=-1; it must be an integer >= 0"),
    (dict(eval_examples=[]), r"eval_examples is empty.*eval_examples=None"),
    (dict(save_every_n_steps=-5), r"save_every_n_steps=-5"),
])
def test_bad_fit_arguments_are_refused_before_any_work(kwargs, message):
    trainer = linear_trainer()
    args = {"train_examples": examples(), "per_device_batch_size": 1, "n_epochs": 1, **kwargs}
    with pytest.raises(ConfigError, match=message):
        trainer.fit(**args)
    assert trainer.step == 0


def test_a_learning_rate_for_an_optimizer_is_refused_at_once():
    deployer = Deployer(verbose=False)
    with pytest.raises(ConfigError, match=r"optimizer is float, not an optax optimizer.*Fix"):
        Trainer(deployer, collate, None, mse, {"w": np.zeros((4, 1), np.float32)}, 1e-3)


def test_an_integer_loss_is_refused():
    def rounded(rng, state, params, batch, is_training):
        return jnp.round(mse(rng, state, params, batch, is_training)).astype(jnp.int32)

    with pytest.raises(LossError, match=r"dtype int32; it must be floating-point.*Fix"):
        linear_trainer(loss=rounded).train(examples(), 1)


def test_a_sharding_rule_that_matches_nothing_is_named():
    from jax.sharding import PartitionSpec as P
    with pytest.warns(UserWarning, match=r"the rule \(\('kernel',\), (P|PartitionSpec)\(\)\) matches "
                                         r"no parameter.*Fix"):
        linear_trainer(rules=[(("kernel",), P()), (("w",), P())])


# -- 7. operator side: logs on disk, streamed exports that keep the dtype, remote paths ----------

def _scalars(logdir):
    from tensorboardX.proto import event_pb2
    values = []
    for name in os.listdir(logdir):
        data = open(os.path.join(logdir, name), "rb").read()
        pos = 0
        while pos + 12 <= len(data):  # TFRecord: length, its CRC, the event, its CRC
            n = int.from_bytes(data[pos:pos + 8], "little")
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            values += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
            pos += 12 + n + 4
    return values


def test_tensorboard_scalars_are_on_disk_at_once_and_the_writer_closes(tmp_path):
    with Deployer(workdir=str(tmp_path), verbose=False, run_tensorboard=True) as deployer:
        for step in range(3):
            deployer.log_metrics({"loss": 1.0 / (step + 1)}, step)
        assert _scalars(tmp_path / "tensorboard") == [("loss", s, pytest.approx(1.0 / (s + 1)))
                                                      for s in range(3)]
    assert deployer.logger._tb is None  # closed at the end of the block


def test_save_pretrained_streams_one_tensor_at_a_time_and_keeps_bf16(tmp_path):
    from safetensors import safe_open

    from redcoast.models.hf import save_folder
    from redcoast.store.tensor_files import Deferred

    alive, peak = [0], [0]

    def fetch(i):
        def make():
            array = np.full((64, 32), i, ml_dtypes.bfloat16)
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])
            weakref.finalize(array, lambda: alive.__setitem__(0, alive[0] - 1))
            return array
        return make

    tensors = {f"layer{i}.weight": Deferred((64, 32), ml_dtypes.bfloat16, fetch(i)) for i in range(6)}
    tensors["bias"] = jnp.arange(5, dtype=jnp.bfloat16)
    save_folder(str(tmp_path), {"model_type": "test"}, tensors)
    assert peak[0] == 1  # never two of them in host memory at once
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        for i in range(6):
            got = f.get_tensor(f"layer{i}.weight")
            assert got.dtype == ml_dtypes.bfloat16 and np.all(got == i)
        np.testing.assert_array_equal(f.get_tensor("bias"), np.arange(5, dtype=ml_dtypes.bfloat16))


def test_export_params_keeps_the_dtype_and_reads_back(tmp_path):
    from safetensors import safe_open

    from redcoast.export import load_params
    deployer = Deployer(verbose=False)
    params = {"dense": {"kernel": jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4),
                        "bias": jnp.ones(4, jnp.float32)}, "step": jnp.int32(3)}
    deployer.export_params(params, str(tmp_path / "out" / "model.safetensors"))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="numpy") as f:
        assert f.get_tensor("dense.kernel").dtype == ml_dtypes.bfloat16
    assert_trees_equal(load_params(str(tmp_path / "out" / "model.safetensors"), params), params)
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]  # no temporary file left


def test_remote_workdirs_are_kept_as_urls_and_local_paths_made_absolute(tmp_path, monkeypatch):
    assert absolute("gs://bucket/runs/a") == "gs://bucket/runs/a"
    monkeypatch.chdir(tmp_path)
    assert absolute("runs/a") == str(tmp_path / "runs" / "a")
    assert CheckpointStore("ckpts").directory == str(tmp_path / "ckpts")


# -- 8. a resume with another batch size trains every example of every epoch exactly once --------
#
# Example i of epoch e has id e * N_IDS + i; the loss is the sum over the batch of w[id], so with
# SGD at rate 1 each update subtracts 1 from w[id] for each example trained: -w counts how many
# times each example was trained.

N_PER_EPOCH = 80  # 5 updates of 16; after one update of epoch 2, 64 left: 8 of 8, 4 of 16, 2 of 32
N_IDS = 2 * N_PER_EPOCH


def id_collate(rows):
    ids = np.array([r["id"] for r in rows])
    return {"onehot": np.eye(N_IDS, dtype=np.float32)[ids]}


def id_loss(rng, state, params, batch, is_training):
    return jnp.sum(batch["onehot"] @ params["w"])


def id_examples(kind):
    """``epoch -> that epoch's examples``: a list (shuffled by epoch) or a generator (a stream)."""
    def of_epoch(epoch):
        rows = ({"id": epoch * N_PER_EPOCH + i} for i in range(N_PER_EPOCH))
        return list(rows) if kind == "list" else rows
    return of_epoch


def id_trainer(workdir, accumulate=1):
    deployer = Deployer(jax_seed=0, workdir=str(workdir), verbose=False)
    # the micro-batches' gradients are averaged: a rate of k keeps each example's count 1
    return Trainer(deployer, id_collate, None, id_loss, {"w": np.zeros((N_IDS,), np.float32)},
                   optax.sgd(float(accumulate)), accumulate_grad_batches=accumulate)


def sigterm_at(trainer, stop_step):
    """Send this process SIGTERM once ``stop_step`` updates are done (the trainer's guard turns it
    into a save and SystemExit(0) after that update, as a preemption would)."""
    log_metrics = trainer.deployer.log_metrics

    def log_and_stop(metrics, step):
        log_metrics(metrics, step)
        if step == stop_step:
            import signal
            signal.raise_signal(signal.SIGTERM)
    trainer.deployer.log_metrics = log_and_stop


def test_a_signal_without_a_workdir_says_nothing_was_saved_and_fails(capsys):
    deployer = Deployer(jax_seed=0, verbose=False)
    trainer = Trainer(deployer, id_collate, None, id_loss, {"w": np.zeros((N_IDS,), np.float32)},
                      optax.sgd(1.0))
    sigterm_at(trainer, 2)
    with pytest.raises(SystemExit) as stop:
        trainer.fit(id_examples("list"), 2, 1, log_every_n_steps=1)
    assert stop.value.code == 128 + 15  # not 0: there is nothing to continue from
    out = capsys.readouterr()
    assert "nothing was saved" in out.out + out.err and "run the same command" not in (out.out + out.err).lower()


def times_trained(trainer):
    return -np.asarray(trainer.params["w"])


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory):
    """For a list and a stream: a workdir stopped by SIGTERM at step 6 (epoch 1, then one update
    of 16 of epoch 2), per_device_batch_size=2."""
    runs = {}
    for kind in ("list", "stream"):
        workdir = tmp_path_factory.mktemp(f"stopped_{kind}")
        trainer = id_trainer(workdir)
        sigterm_at(trainer, 6)
        with pytest.raises(SystemExit) as stop:
            trainer.fit(id_examples(kind), 2, 2, log_every_n_steps=1)
        assert stop.value.code == 0 and trainer.step == 6
        counts = times_trained(trainer)
        assert counts[:N_PER_EPOCH].tolist() == [1] * N_PER_EPOCH and counts[N_PER_EPOCH:].sum() == 16
        runs[kind] = workdir
    return runs


def resume_from(stopped, tmp_path, kind, per_device_batch_size, accumulate=1):
    import shutil
    workdir = tmp_path / "resumed"
    shutil.copytree(stopped, workdir)
    trainer = id_trainer(workdir, accumulate)
    trainer.fit(id_examples(kind), per_device_batch_size, 2, log_every_n_steps=1)
    return trainer, (workdir / "log.txt").read_text()


@pytest.mark.parametrize("kind", ["list", "stream"])
@pytest.mark.parametrize("per_device_batch_size, accumulate, updates_left", [
    (1, 1, 8), (4, 1, 2),  # half and double the batch (16 examples trained: not a multiple of 32)
    (2, 1, 4),  # the same batch
    (1, 4, 2),  # double the update by accumulation
])
def test_a_resume_with_another_batch_size_trains_each_example_once(
        stopped_runs, tmp_path, kind, per_device_batch_size, accumulate, updates_left):
    trainer, log = resume_from(stopped_runs[kind], tmp_path, kind, per_device_batch_size, accumulate)
    assert trainer.step == 6 + updates_left
    np.testing.assert_array_equal(times_trained(trainer), np.ones(N_IDS))  # each once, none lost
    assert "its first 16 examples" in log and "were trained before the checkpoint" in log


def test_a_resume_whose_updates_do_not_divide_the_rest_leaves_out_only_the_last(stopped_runs, tmp_path):
    from redcoast.data import epoch_order
    trainer, log = resume_from(stopped_runs["list"], tmp_path, "list", 3)  # updates of 24
    assert trainer.step == 6 + 2  # 64 left: 2 updates of 24, the last 16 not an update
    counts = times_trained(trainer)[N_PER_EPOCH:]
    order = epoch_order(N_PER_EPOCH, 0, 1)
    np.testing.assert_array_equal(counts[order[:64]], np.ones(64))  # the first 64: each once
    np.testing.assert_array_equal(counts[order[64:]], np.zeros(16))  # the last 16 left out, said
    assert "epoch 2: its last 16 examples do not fill an update of 24 and were left out" in log


def _write_old_meta(workdir, keep_config=True):
    """Turn the newest checkpoint's meta into the previous format: the position in updates only."""
    steps = workdir / "checkpoints" / "steps"
    newest = max((p for p in steps.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    [path] = [p for p in (newest / "meta").rglob("*") if p.is_file() and "position" in p.read_text()]
    meta = json.loads(path.read_text())
    meta.pop("examples_consumed", None)
    if not keep_config:
        meta["config"] = {}
    path.write_text(json.dumps(meta))
    return meta


@pytest.mark.parametrize("keep_config", [True, False])
def test_a_checkpoint_in_the_previous_format_still_resumes(stopped_runs, tmp_path, keep_config):
    import shutil
    workdir = tmp_path / "old"
    shutil.copytree(stopped_runs["stream"], workdir)
    meta = _write_old_meta(workdir, keep_config)
    assert (meta["epoch"], meta["position"]) == (1, 1)
    trainer = id_trainer(workdir)
    # with the batch size it recorded (16 a update): 1 update = 16 examples skipped; without it,
    # the current one is assumed (the same here), with a warning
    trainer.fit(id_examples("stream"), 2 if not keep_config else 4, 2, log_every_n_steps=1)
    np.testing.assert_array_equal(times_trained(trainer), np.ones(N_IDS))
    log = (workdir / "log.txt").read_text()
    assert "its first 16 examples" in log
    assert ("does not record how many examples" in log) == (not keep_config)


# -- 9. an evaluation that fails loses no training: the checkpoint is written before it ---------

def predictor_of(trainer):
    return trainer.get_default_predictor(lambda rng, params, batch: batch["x"] @ params["w"])


def metric_failing_at(calls):
    """A metric that raises at its ``calls``-th call (counting from 1)."""
    seen = []

    def metric(examples, preds):
        seen.append(1)
        if len(seen) == calls:
            raise ZeroDivisionError("the metric divided by zero")
        return {"mean_pred": float(np.mean(preds))}
    return metric


@pytest.mark.parametrize("every", ["epoch", "steps"])
def test_a_failing_evaluation_keeps_the_checkpoint_written_before_it(tmp_path, every):
    saving = (dict(save_every_k_epochs=1) if every == "epoch" else
              dict(save_every_n_steps=2, eval_every_n_steps=2))
    trainer = linear_trainer(tmp_path)
    held_out = examples(8, seed=1)
    with pytest.raises(EvaluationError) as failed:
        trainer.fit(examples(), 1, 2, eval_examples=held_out, eval_predictor=predictor_of(trainer),
                    eval_metric_fn=metric_failing_at(1), **saving)
    step = 4 if every == "epoch" else 2
    assert trainer.step == step
    where = str(tmp_path / "checkpoints" / "steps" / str(step))
    saved = "epoch 1 is saved at" if every == "epoch" else f"step {step} is saved at"
    label = "epoch 1/2" if every == "epoch" else f"step {step}"
    message = str(failed.value)
    assert f"the evaluation after {label} failed in eval_metric_fn: ZeroDivisionError: the metric " \
           f"divided by zero; {saved} {where} and a rerun resumes from there" in message, message
    assert isinstance(failed.value.__cause__, ZeroDivisionError)
    assert os.listdir(tmp_path / "checkpoints" / "steps") == [str(step)]
    # the rerun, with the metric fixed, goes on from there as if nothing had failed
    rerun = linear_trainer(tmp_path)
    rerun.fit(examples(), 1, 2, eval_examples=held_out, eval_predictor=predictor_of(rerun),
              eval_metric_fn=metric_failing_at(0), **saving)
    assert f"resumed from {where}: step {step}" in (tmp_path / "log.txt").read_text()
    uninterrupted = linear_trainer()
    uninterrupted.fit(examples(), 1, 2)
    assert rerun.step == 8
    assert_trees_equal(rerun.params, uninterrupted.params)


def test_a_best_kept_by_the_evaluation_after_a_checkpoint_is_remembered_on_resume(tmp_path):
    # the checkpoint of epoch 1 is written before its evaluation, so its record does not hold the
    # best that evaluation kept: a resume reads it from the best checkpoint itself
    held_out = examples(8, seed=1)
    kwargs = dict(eval_examples=held_out, save_every_k_epochs=1, save_argmax_ckpt_by_metrics=["loss"])
    linear_trainer(tmp_path).fit(examples(), 1, 1, **kwargs)  # epoch 1: the best (the only one)
    best = tmp_path / "checkpoints" / "best_max_loss"
    assert os.listdir(best) == ["4"]
    linear_trainer(tmp_path).fit(examples(), 1, 2, **kwargs)  # epoch 2's loss is lower: not the max
    assert os.listdir(best) == ["4"]


def test_an_evaluation_failing_without_a_checkpoint_says_so():
    trainer = linear_trainer()
    with pytest.raises(EvaluationError, match=r"after epoch 1/1 failed in eval_metric_fn: .*no "
                                              r"checkpoint was saved.*Fix:.*workdir=\.\.\."):
        trainer.fit(examples(), 1, 1, eval_examples=examples(8, seed=1),
                    eval_predictor=predictor_of(trainer), eval_metric_fn=metric_failing_at(1))


def test_a_metric_that_returns_a_float_is_refused_after_the_epoch_is_saved(tmp_path):
    trainer = linear_trainer(tmp_path)
    with pytest.raises(EvaluationError, match=r"failed in eval_metric_fn: ConfigError: "
                                              r"eval_metric_fn returned float \(0\.5\); it must "
                                              r"return a dict.*Fix: return a dict.*epoch 1 is saved"):
        trainer.fit(examples(), 1, 2, eval_examples=examples(8, seed=1), save_every_k_epochs=1,
                    eval_predictor=predictor_of(trainer), eval_metric_fn=lambda e, p: 0.5)
    assert os.listdir(tmp_path / "checkpoints" / "steps") == ["4"]


def test_eval_inputs_that_would_fail_late_are_refused_before_any_training():
    trainer = linear_trainer()
    for sanity_check in (False, True):  # redco's eval_sanity_check reads it before fit's checks
        with pytest.raises(ConfigError, match=r"eval_examples is a generator, without len\(\) and "
                                              r"indexing.*Fix: eval_examples=list\(eval_examples\)"):
            trainer.fit(examples(), 1, 1, eval_examples=(e for e in examples(8)),
                        eval_sanity_check=sanity_check)
    assert trainer.step == 0

    def no_eval_loss(rng, state, params, batch, is_training):
        if is_training:
            return mse(rng, state, params, batch, is_training)

    trainer = linear_trainer(loss=no_eval_loss)
    with pytest.raises(LossError, match=r"loss_fn returned None.*Fix: return the loss on every "
                                        r"path.*before any training.*is_training=False.*eval_loss=False"):
        trainer.fit(examples(), 1, 1, eval_examples=examples(8))
    assert trainer.step == 0
    trainer.fit(examples(), 1, 1, eval_examples=examples(8), eval_loss=False)  # nothing to check
    assert trainer.step == 4
