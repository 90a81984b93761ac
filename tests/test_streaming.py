"""Streams as train_examples (generators, iterables, datasets.IterableDataset), exact resume of a
stream, max_steps and evaluation every N steps. A noisy linear regression on 8 devices, batch 8."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from redcoast import ConfigError, DataError, Deployer, Trainer
from redcoast.store.checkpoint import CheckpointStore
import stream_worker
from stream_worker import noisy_mse, stream

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "stream_worker.py")


def examples(n=36, epoch=0):
    """36 examples: 4 updates of 8 and 4 left over."""
    return list(itertools.islice(stream(epoch), n))


def collate(rows):
    return {k: np.stack([r[k] for r in rows]).astype(np.float32) for k in rows[0]}


def linear_trainer(workdir=None, lr=0.05):
    deployer = Deployer(jax_seed=0, workdir=None if workdir is None else str(workdir), verbose=False)
    params = {"w": np.zeros((4, 1), np.float32), "b": np.zeros((1,), np.float32)}
    return Trainer(deployer, collate, None, noisy_mse, params, optax.adam(lr))


def fit(train_examples, workdir=None, **kwargs):
    trainer = linear_trainer(workdir)
    kwargs = {"per_device_batch_size": 1, "n_epochs": 1, "shuffle": False, **kwargs}
    trainer.fit(train_examples, **kwargs)
    return trainer


def host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def assert_bitwise(a, b):
    jax.tree_util.tree_map(np.testing.assert_array_equal, host(a), host(b))


def records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


# -- streams train as the same examples in a list, in order --------------------------------------

def test_a_generator_trains_as_the_same_examples_in_a_list_without_shuffle():
    reference = fit(examples())
    generator = fit(e for e in examples())  # a one-shot iterator, one epoch
    assert generator.step == reference.step == 4
    assert_bitwise(generator.params, reference.params)


def test_a_stream_with_accumulated_micro_batches_trains_as_the_list():
    def run(train_examples):
        deployer = Deployer(jax_seed=0, verbose=False)
        params = {"w": np.zeros((4, 1), np.float32), "b": np.zeros((1,), np.float32)}
        trainer = Trainer(deployer, collate, None, noisy_mse, params, optax.adam(0.05),
                          accumulate_grad_batches=2)
        trainer.fit(train_examples, 1, 1, shuffle=False)
        return trainer
    streamed, listed = run(iter(examples())), run(examples())
    assert streamed.step == listed.step == 2  # updates of 16; 4 examples left out
    assert_bitwise(streamed.params, listed.params)


def test_a_function_of_the_epoch_returning_a_generator_streams_each_epoch():
    asked = []

    def of_epoch(epoch):
        asked.append(epoch)
        return (e for e in examples(epoch=epoch))

    streamed = fit(of_epoch, n_epochs=2)
    assert asked == [0, 1]
    # the same updates, read from one list: each epoch's first 32 examples (4 left over each)
    reference = fit(examples(32, epoch=0) + examples(32, epoch=1))
    assert streamed.step == reference.step == 8
    assert_bitwise(streamed.params, reference.params)


@pytest.mark.slow  # ~15 s with datasets' own iteration
def test_a_zero_argument_function_and_a_datasets_iterable_dataset_stream():
    datasets = pytest.importorskip("datasets")
    rows = examples()
    dataset = datasets.IterableDataset.from_generator(
        lambda: ({"x": r["x"].tolist(), "y": float(r["y"])} for r in rows))
    assert not hasattr(dataset, "__len__")
    reference = fit(rows[:32] + rows[:32])  # each epoch: 4 updates, the last 4 examples left out
    for source in (dataset, lambda: iter(rows)):
        trainer = fit(source, n_epochs=2)
        assert trainer.step == 8
        assert_bitwise(trainer.params, reference.params)


# -- exact resume ------------------------------------------------------------------------------------

def test_a_stream_stopped_mid_epoch_resumes_bitwise(tmp_path):
    uninterrupted = stream_worker.train(tmp_path / "a")
    stopped = stream_worker.train(tmp_path / "b", max_steps=7, save_last_ckpt=True)
    assert stopped.step == 7
    store = CheckpointStore(str(tmp_path / "b" / "checkpoints" / "steps"))
    meta = linear_trainer().restore_checkpoint(store)
    store.close()
    # epoch 2 (of 5 updates each), 2 updates (16 examples, skipped on resume) into it
    assert (meta["epoch"], meta["position"]) == (1, 2)
    resumed = stream_worker.train(tmp_path / "b")
    assert resumed.step == uninterrupted.step == 10
    assert_bitwise(resumed.params, uninterrupted.params)
    assert "resumed from" in (tmp_path / "b" / "log.txt").read_text()
    log = (tmp_path / "a" / "log.txt").read_text()  # nothing left out silently
    for epoch in (1, 2):
        assert f"epoch {epoch}: its last 4 examples do not fill an update of 8 and were left out" in log


def worker(workdir, out, slow=0.0):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, WORKER, str(workdir), str(out), str(slow)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # ~30 s: three processes; the in-process stop-and-resume above is the fast one
def test_a_generator_killed_mid_epoch_resumes_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    workdir, out = tmp_path / "workdir", tmp_path / "final.npz"
    p = worker(workdir, out, slow=0.3)  # about 0.3 s per update
    mid_epoch = workdir / "checkpoints" / "steps" / "6"  # epoch 2, 1 update into it
    deadline = time.time() + 120
    while not mid_epoch.is_dir() and p.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    log, _ = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL, log[-3000:]
    assert mid_epoch.is_dir() and not out.exists()
    p = worker(workdir, out)
    log, _ = p.communicate(timeout=300)
    assert p.returncode == 0, log[-3000:]
    assert "finished at step 10" in log
    resumed = dict(np.load(out))
    del resumed["collated"]
    assert "resumed from" in (workdir / "log.txt").read_text()
    uninterrupted = stream_worker.train(tmp_path / "uninterrupted")
    expected = {"w": np.asarray(uninterrupted.params["w"]), "b": np.asarray(uninterrupted.params["b"])}
    assert sorted(resumed) == sorted(expected)
    for k in expected:
        np.testing.assert_array_equal(resumed[k], expected[k], err_msg=k)


def test_a_bare_generator_resumes_with_a_warning_naming_the_fix(tmp_path):
    uninterrupted = fit(e for e in examples())
    stopped = fit((e for e in examples()), tmp_path, max_steps=3, save_last_ckpt=True)
    assert stopped.step == 3
    resumed = fit((e for e in examples()), tmp_path)  # the script run again: a new generator
    assert resumed.step == 4
    assert_bitwise(resumed.params, uninterrupted.params)
    log = (tmp_path / "log.txt").read_text()
    assert "cannot be rewound" in log and "skips the first 24 examples" in log
    assert "lambda epoch: my_generator(epoch)" in log


def test_a_stream_shorter_than_what_the_checkpoint_consumed_is_an_error(tmp_path):
    fit(iter(examples()), tmp_path, max_steps=3, save_last_ckpt=True)
    with pytest.raises(DataError, match=r"ended after 20 examples.*24 of them were trained on.*Fix"):
        fit(iter(examples(20)), tmp_path)


def test_a_stream_that_gives_other_examples_after_a_restart_is_refused(tmp_path):
    """The checkpoint keeps a fingerprint of the examples it consumed: a resumed stream must give
    those first (a generator that went on where it was, or another shuffle, would skip others)."""
    fit(iter(examples()), tmp_path, max_steps=3, save_last_ckpt=True)
    shifted = examples(40)[4:]  # same kind and count, other examples
    with pytest.raises(DataError, match=r"other examples than the interrupted run read: the first "
                                        r"24 examples of epoch 1.*Fix: give the same examples"):
        fit(iter(shifted), tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoints" / "steps")) == ["3"]  # nothing lost
    resumed = fit(iter(examples()), tmp_path)  # the same examples: resumes
    assert resumed.step == 4


def test_an_iterator_with_max_steps_beyond_its_end_trains_one_pass_and_saves_it(tmp_path):
    """Read once, its pass is the last epoch: saved as such, not an error at a second epoch."""
    trainer = fit(iter(examples()), tmp_path, n_epochs=None, max_steps=10, save_last_ckpt=True)
    assert trainer.step == 4  # 36 examples: 4 updates of 8
    assert sorted(os.listdir(tmp_path / "checkpoints" / "steps")) == ["4"]
    assert "can be read once: this run trains one pass over it" in (tmp_path / "log.txt").read_text()
    assert_bitwise(trainer.params, fit(examples()).params)


# -- max_steps -----------------------------------------------------------------------------------------

def test_max_steps_stops_across_epochs_then_evaluates_and_saves(tmp_path):
    rows = examples(32)  # 4 updates per epoch
    trainer = fit(rows, tmp_path, n_epochs=3, max_steps=6, eval_examples=rows[:8],
                  save_last_ckpt=True)
    assert trainer.step == 6
    # epoch 1 and half of epoch 2, in order: one pass over 48 examples
    reference = linear_trainer()
    reference.train(rows + rows[:16], 1, shuffle=False)
    assert_bitwise(trainer.params, reference.params)
    evals = [r for r in records(tmp_path) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 6]
    np.testing.assert_allclose(evals[-1]["eval_loss"], reference.eval_loss(rows[:8], 1), rtol=1e-6)
    assert sorted(os.listdir(tmp_path / "checkpoints" / "steps")) == ["6"]
    # continued with a larger max_steps, it goes on from there as if never stopped
    more = fit(rows, tmp_path, n_epochs=3, max_steps=10)
    reference.train(rows[16:] + rows[:16], 1, shuffle=False)
    assert more.step == reference.step == 10
    assert_bitwise(more.params, reference.params)


def test_an_endless_stream_trains_for_max_steps_with_n_epochs_none():
    rows = examples(32)
    trainer = fit(itertools.cycle(rows), n_epochs=None, max_steps=10)
    assert trainer.step == 10
    assert_bitwise(trainer.params, fit(rows + rows + rows[:16]).params)


def test_an_lr_schedule_over_max_steps():
    deployer = Deployer(verbose=False)
    schedule = deployer.get_lr_schedule_fn(learning_rate=1.0, max_steps=10)
    np.testing.assert_allclose([schedule(0), schedule(5), schedule(10)], [1.0, 0.5, 0.0])
    # both known: the fewer updates (36 examples of 8 over 3 epochs = 12 > 10)
    both = deployer.get_lr_schedule_fn(36, 1, 3, 1.0, max_steps=10)
    np.testing.assert_allclose(both(5), 0.5)
    with pytest.raises(ConfigError, match="max_steps"):
        deployer.get_lr_schedule_fn(per_device_batch_size=1, learning_rate=1.0)


# -- evaluation every N steps ------------------------------------------------------------------------

def test_eval_every_n_steps_logs_with_the_step_and_keeps_the_best(tmp_path):
    rows = examples(32)
    held_out = examples(16, epoch=9)
    trainer = fit(rows, tmp_path, n_epochs=2, eval_examples=held_out, eval_every_n_steps=3,
                  save_argmax_ckpt_by_metrics=["loss"])
    assert trainer.step == 8
    evals = [r for r in records(tmp_path) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 4, 6, 8]  # every 3 updates and each epoch's end
    # each the loss of the parameters after that many updates, computed here update by update
    reference, losses = linear_trainer(), {}
    for epoch in range(2):
        reference.train(rows, 1, shuffle=False, epoch=epoch, after_step=lambda position: losses.
                        setdefault(reference.step, reference.eval_loss(held_out, 1)) and False)
    for r in evals:
        np.testing.assert_allclose(r["eval_loss"], losses[r["step"]], rtol=1e-6)
    worst = max(evals, key=lambda r: r["eval_loss"])  # argmax: here a step's eval is the best
    store = CheckpointStore(str(tmp_path / "checkpoints" / "best_max_loss"))
    meta = linear_trainer().restore_checkpoint(store)
    store.close()
    assert meta["step"] == worst["step"] == 3


def test_an_eval_at_an_epoch_end_is_not_repeated(tmp_path):
    rows = examples(32)
    fit(rows, tmp_path, n_epochs=2, eval_examples=rows[:8], eval_every_n_steps=2)
    evals = [r["step"] for r in records(tmp_path) if "eval_loss" in r]
    assert evals == [2, 4, 6, 8]


# -- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("train_examples, kwargs, message", [
    (lambda: itertools.cycle(examples(8)), {}, r"never ends.*Fix: pass max_steps"),
    (lambda: (e for e in examples()), {"n_epochs": 2}, r"iterator \(generator\).*read once.*n_epochs=2.*"
     r"Fix: pass a function returning a fresh iterator"),
    (lambda: examples(), {"n_epochs": None}, r"n_epochs=None.*only with max_steps"),
    (lambda: examples(), {"eval_every_n_steps": 2}, r"eval_examples is None.*Fix"),
    (lambda: examples(), {"max_steps": 0}, r"max_steps=0; it must be a positive integer"),
    (lambda: iter(examples(5)), {}, r"ended after 5 examples, fewer than one batch of 8.*Fix"),
])
def test_stream_arguments_are_refused_with_the_fix(train_examples, kwargs, message):
    trainer = linear_trainer()
    with pytest.raises(ConfigError, match=message):
        trainer.fit(train_examples(), 1, **{"n_epochs": 1, **kwargs})
    assert trainer.step == 0


def test_a_stream_that_ends_before_an_update_in_a_later_epoch_is_named():
    def of_epoch(epoch):  # 40 examples, then 4
        return iter(examples(40 if epoch == 0 else 4))
    trainer = linear_trainer()
    with pytest.raises(ConfigError, match=r"ended after 4 examples in epoch 2, fewer than one update"):
        trainer.fit(of_epoch, 1, 2, shuffle=False)
    assert trainer.step == 5


@pytest.mark.slow  # ~1 min: two processes
def test_two_processes_read_the_same_stream_and_collate_only_their_rows(tmp_path):
    from test_multiprocess import child_env, free_port
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, WORKER, str(tmp_path / "workdir"), str(tmp_path / f"out{i}.npz"), "0",
         str(i), "2", str(port), "4"], env=child_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=500)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    collated = []
    single = stream_worker.train(tmp_path / "single", collated=collated)
    # the first batch collated once to trace the loss, then 10 updates (5 an epoch)
    assert collated == [8] * 11  # one process: the whole batch of 8
    for i in range(2):
        out = dict(np.load(tmp_path / f"out{i}.npz"))
        assert out["collated"].tolist() == [4] * 11  # each of 2 processes: its own 4 rows
        for k in ("w", "b"):  # the same updates, up to the order of the sums across processes
            np.testing.assert_allclose(out[k], np.asarray(single.params[k]), rtol=1e-5, atol=1e-6)
