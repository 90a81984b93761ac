"""Checkpoints: exact resume after kills and signals, restore onto other meshes, damage, export."""

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import optax
import pytest
from filelock import FileLock

from redcoast import ConfigError, Deployer, Trainer
from redcoast.store.checkpoint import CheckpointStore
from tiny_lm import TinyLM, collate_fn, loss_fn, make_examples, make_model

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ckpt_worker.py")


def worker(workdir, out, slow=0.0):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, WORKER, str(workdir), str(out), str(slow)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(workdir, out):
    p = worker(workdir, out)
    log, _ = p.communicate(timeout=300)
    assert p.returncode == 0, log[-3000:]
    return dict(np.load(out)), log


def assert_bitwise_equal(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, worker_id):
    """The uninterrupted run's parameters, run once per test session: CI's two xdist workers
    share it through their common temporary folder (40 s each before)."""
    if worker_id == "master":  # no xdist
        d = tmp_path_factory.mktemp("uninterrupted")
        return finish(d / "workdir", d / "final.npz")[0]
    d = tmp_path_factory.getbasetemp().parent / "uninterrupted"
    with FileLock(str(d) + ".lock"):
        if not (d / "final.npz").exists():
            d.mkdir(exist_ok=True)
            finish(d / "workdir", d / "partial.npz")
            os.replace(d / "partial.npz", d / "final.npz")
    return dict(np.load(d / "final.npz"))


def saving_in_progress(workdir):
    steps = os.path.join(workdir, "checkpoints", "steps")
    return os.path.isdir(steps) and any("tmp" in name for name in os.listdir(steps))


def kill_and_resume(tmp_path, uninterrupted, rng, inside_save):
    workdir, out = tmp_path / "workdir", tmp_path / "final.npz"
    p = worker(workdir, out)
    deadline = time.time() + (120 if inside_save else rng.uniform(3.0, 12.0))
    while time.time() < deadline and p.poll() is None:
        if inside_save and saving_in_progress(workdir):
            break
        time.sleep(0.002)
    p.kill()
    p.wait()
    params, log = finish(workdir, out)
    assert_bitwise_equal(params, uninterrupted)
    return log


@pytest.mark.slow  # ten trials, each its own test so that CI's two workers share them
@pytest.mark.parametrize("trial", range(10))
def test_ten_random_sigkills(tmp_path, uninterrupted, trial):
    kill_and_resume(tmp_path, uninterrupted, random.Random(1000 + trial), inside_save=trial % 2 == 0)


@pytest.mark.slow  # 40 s
def test_sigterm_saves_exits_zero_and_resumes(tmp_path, uninterrupted):
    workdir, out = tmp_path / "workdir", tmp_path / "final.npz"
    p = worker(workdir, out, slow=0.3)  # about 0.3 s per update
    first = os.path.join(workdir, "checkpoints", "steps", "3")
    deadline = time.time() + 120
    while not os.path.isdir(first) and time.time() < deadline:
        time.sleep(0.05)
    sent = time.time()
    p.send_signal(signal.SIGTERM)
    log, _ = p.communicate(timeout=60)
    elapsed = time.time() - sent
    assert p.returncode == 0, log[-3000:]
    assert elapsed < 10, elapsed  # one step (~0.3 s) plus a small save
    assert "SIGTERM received" in log
    params, log = finish(workdir, out)
    assert_bitwise_equal(params, uninterrupted)


def trained_trainer(n_model_shards, workdir):
    model, params = make_model()
    deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, workdir=str(workdir), verbose=False)
    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.adamw(1e-2))
    return trainer


def test_restore_onto_other_meshes(tmp_path):
    saver = trained_trainer(2, tmp_path)
    saver.fit(make_examples(32), 1, 1, save_last_ckpt=True)
    saved = {k: np.asarray(v) for k, v in _flat(saver.state.opt_state).items()}
    saved_params = {k: np.asarray(v) for k, v in _flat(saver.params).items()}
    for n_model_shards in (4, 1):
        restorer = trained_trainer(n_model_shards, tmp_path)
        meta = restorer.restore_checkpoint(CheckpointStore(tmp_path / "checkpoints" / "steps"))
        assert meta["step"] == saver.step == restorer.step
        for k, v in _flat(restorer.params).items():
            np.testing.assert_array_equal(np.asarray(v), saved_params[k])
            assert v.sharding.mesh.shape["mp"] == n_model_shards
        for k, v in _flat(restorer.state.opt_state).items():
            np.testing.assert_array_equal(np.asarray(v), saved[k])


def _flat(tree):
    import jax
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_damaged_checkpoint_is_skipped_with_a_warning(tmp_path, capsys):
    trainer = trained_trainer(2, tmp_path)
    trainer.fit(make_examples(32), 1, 1, save_every_n_steps=3, keep_last_n_ckpts=3)  # 8 updates
    steps_dir = tmp_path / "checkpoints" / "steps"
    # every 3 updates, and the end (fit saves it where the run resumes)
    assert sorted(int(s) for s in os.listdir(steps_dir) if s.isdigit()) == [3, 6, 8]
    for root, _, files in os.walk(steps_dir / "8" / "state"):
        for name in files:  # truncate every data file of the newest checkpoint
            with open(os.path.join(root, name), "r+b") as f:
                f.truncate(0)
    restorer = trained_trainer(2, tmp_path)
    restorer.deployer.logger.enabled = True
    meta = restorer.restore_checkpoint(CheckpointStore(steps_dir, logger=None))
    assert meta["step"] == 6
    assert f"checkpoint {steps_dir / '8'} is damaged" in capsys.readouterr().out


def test_checkpoint_of_another_model_names_the_differences(tmp_path):
    trained_trainer(2, tmp_path).fit(make_examples(32), 1, 1, save_last_ckpt=True)
    other = TinyLM(n_layers=1)
    import jax
    import jax.numpy as jnp
    params = other.init(jax.random.PRNGKey(0), jnp.zeros((1, 12), jnp.int32))["params"]
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(tmp_path), verbose=False)
    trainer = Trainer(deployer, collate_fn, other.apply, loss_fn, params, optax.adamw(1e-2))
    with pytest.raises(ConfigError, match=r"(?s)holds another model.*in the checkpoint, not the "
                                          r"model: params/block_1/LayerNorm_0/bias \(32,\)"):
        trainer.fit(make_examples(32), 1, 1)
    assert not (tmp_path / "redcoast.lock").exists()  # a refused resume releases the workdir


def test_nan_checkpoints_are_never_written(tmp_path):
    import jax.numpy as jnp
    from redcoast import NonFiniteLossError

    def nan_after_two(rng, state, params, batch, is_training):
        loss, metrics = loss_fn(rng, state, params, batch, is_training)
        return jnp.where(state.step >= 2, jnp.nan, loss), metrics

    model, params = make_model()
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(tmp_path), verbose=False)
    trainer = Trainer(deployer, collate_fn, model.apply, nan_after_two, params, optax.adamw(1e-2))
    with pytest.raises(NonFiniteLossError, match="at step 2"):
        trainer.fit(make_examples(32), 1, 1, save_every_n_steps=2, log_every_n_steps=100)
    saved = os.listdir(tmp_path / "checkpoints" / "steps")
    assert [s for s in saved if s.isdigit()] == ["2"]  # the state after 2 good updates only


def test_export_params_is_plain_safetensors(tmp_path):
    from safetensors.numpy import load_file
    model, params = make_model()
    deployer = Deployer(n_model_shards=2, verbose=False)
    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.adamw(1e-2))
    deployer.export_params(trainer.params, str(tmp_path / "model.safetensors"))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    np.testing.assert_array_equal(tensors["block_1.fc_in.kernel"], params["block_1"]["fc_in"]["kernel"])
    assert len(tensors) == len(__import__("jax").tree_util.tree_leaves(params))


def test_kv_heads_kept_by_groups_of_shards_save_and_restore_onto_other_meshes(tmp_path):
    # 2 KV heads on 4 shards are split over 2 groups of shards ('mp:2', a mesh of the same
    # devices viewed as (dp, groups, within)); a checkpoint restores onto 8 shards (2 groups of
    # 4) and onto 1 (replicated), into the traced plan's layout, with the same values
    from jax.sharding import PartitionSpec as P

    from architectures import gqa
    from redcoast.sharding.rules import normalize_spec

    arch = gqa(n_layers=1)
    rows = [{k: v[i] for k, v in arch.batch.items()} for i in range(len(arch.batch["inputs"]))]

    def trainer(n):
        deployer = Deployer(jax_seed=0, n_model_shards=n, workdir=str(tmp_path), verbose=False)
        return Trainer(deployer, lambda rs: {k: np.stack([r[k] for r in rs]) for k in rs[0]}, None,
                       lambda rng, state, params, batch, is_training: arch.loss(params, batch),
                       arch.params, optax.adamw(1e-2), fuse_matmuls=True)

    saver = trainer(4)
    saver.fit(rows, 4, 1, save_last_ckpt=True)  # per device: 4 x 2 data shards = the batch
    k = saver.params["layers"][0]["k"]
    assert "mp:2" in k.sharding.spec and k.addressable_shards[0].data.shape[1] == 1
    saved = {kp: np.asarray(x) for kp, x in _flat((saver.params, saver.state.opt_state)).items()}
    for n in (8, 1):
        restorer = trainer(n)
        restorer.compile_train_step(arch.batch)  # the traced plan: K/V by groups of 4 shards on 8
        k_spec = lambda: normalize_spec(restorer.params["layers"][0]["k"].sharding.spec)  # noqa: E731
        want = P(None, "mp:2") if n == 8 else P()
        assert k_spec() == want
        restorer.restore_checkpoint(CheckpointStore(tmp_path / "checkpoints" / "steps"))
        got = _flat((restorer.params, restorer.state.opt_state))
        assert sorted(got) == sorted(saved)
        for kp, x in got.items():
            np.testing.assert_array_equal(np.asarray(x), saved[kp], err_msg=f"{n} shards: {kp}")
        assert k_spec() == want  # restored into the traced layout


def test_export_refuses_two_leaves_of_one_tensor_name_before_writing(tmp_path):
    from redcoast.export import save_params
    x, y = np.zeros(2, np.float32), np.ones(3, np.float32)
    with pytest.raises(ConfigError, match=r"params\['a'\]\['b'\] and params\['a.b'\].*'a\.b'"):
        save_params({"a.b": x, "a": {"b": y}}, str(tmp_path / "m.safetensors"))
    assert os.listdir(tmp_path) == []


def test_export_onto_a_directory_is_a_clear_error_and_leaves_nothing(tmp_path):
    from redcoast.export import save_params
    (tmp_path / "out").mkdir()
    with pytest.raises(ConfigError, match=r"is a directory.*Fix: pass a file path"):
        save_params({"a": np.zeros(2, np.float32)}, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(tmp_path / "out") == []


def test_a_failed_export_leaves_no_temporary_file(tmp_path):
    from redcoast.store.tensor_files import Deferred, entry, write_safetensors

    def fails():
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        write_safetensors(str(tmp_path / "m.safetensors"),
                          [entry("a", np.zeros(2, np.float32)),
                           entry("b", Deferred((2,), np.float32, fails))])
    assert os.listdir(tmp_path) == []


def test_relative_workdir_is_resolved_when_the_deployer_is_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    deployer = Deployer(jax_seed=0, n_model_shards=1, workdir="run", verbose=False)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # a notebook's %cd
    assert deployer.workdir == str(tmp_path / "run") == deployer.logger.workdir
    deployer.close()


@pytest.mark.slow  # a fit with evaluation and two checkpoints: ~15 s on the loaded 2-core box
def test_relative_workdir_stays_where_it_was_after_chdir(tmp_path, monkeypatch):
    """A notebook's %cd after the Deployer was made moves none of the run's files."""
    monkeypatch.chdir(tmp_path)
    model, params = make_model()
    deployer = Deployer(jax_seed=0, n_model_shards=1, workdir="run", verbose=False)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.sgd(1e-2),
                      fsdp=False, fuse_matmuls=False)
    trainer.fit(make_examples(8), 1, 1, eval_examples=make_examples(8), save_last_ckpt=True,
                save_argmin_ckpt_by_metrics=["loss"])
    assert os.listdir(tmp_path / "elsewhere") == []
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["best_min_loss", "steps"]


@pytest.mark.parametrize("min_bytes, small_whole", [(None, True), (0, False)],
                         ids=["redcoast", "orbax-default"])
def test_small_replicated_arrays_are_written_whole_and_large_ones_in_replica_slices(
        tmp_path, min_bytes, small_whole):
    """Orbax writes an array several devices hold in slices, one per holder; below
    REPLICA_SLICE_MIN_BYTES a slice costs more than it saves, so the store writes it whole (0:
    Orbax's own default, which slices both). The write shapes are what Orbax's array metadata
    records, next to the arrays as its default handler writes them; both restore exactly."""
    import json

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from redcoast.store.checkpoint import REPLICA_SLICE_MIN_BYTES

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "mp"))
    replicated = NamedSharding(mesh, P())
    rows = 8 * REPLICA_SLICE_MIN_BYTES // (4 * 1024)  # 8 slices of the minimum size
    state = {"small": jax.device_put(jnp.arange(64 * 64.0).reshape(64, 64), replicated),
             "large": jax.device_put(jnp.arange(rows * 1024.0).reshape(rows, 1024), replicated)}
    store = CheckpointStore(tmp_path, async_save=False, replica_slice_min_bytes=min_bytes)
    store.save(1, state, {"step": 1})
    store.wait()
    written = json.loads((tmp_path / "1" / "state" / "array_metadatas" / "process_0").read_text())
    write_shapes = {m["array_metadata"]["param_name"]: m["array_metadata"]["write_shape"]
                    for m in written["array_metadatas"]}
    assert write_shapes["small"] == ([64, 64] if small_whole else [8, 64])
    assert write_shapes["large"] == [rows // 8, 1024]
    restored, meta = store.restore_latest(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
    store.close()
    assert meta == {"step": 1}
    for name in state:
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(state[name]))
