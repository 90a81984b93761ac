"""Callbacks: the hooks fit runs, EarlyStopping against a hand count, the History fit returns, and
a finished run that stays finished."""

import json
import os

import jax.numpy as jnp
import optax
import pytest

from redcoast import Callback, ConfigError, Deployer, EarlyStopping, History, Trainer
from redcoast.progress import Progress
from tiny_lm import collate_fn, loss_fn, make_examples, make_model


class At:
    """What EarlyStopping reads of a run: its step."""

    def __init__(self):
        self.trainer = self

    def step_to(self, step):
        self.progress = Progress(step=step)
        return self


def stops(callback, values):
    """The 1-based evaluation at which ``callback`` stops on ``values``, or None."""
    run = At()
    for i, value in enumerate(values, 1):
        if callback.after_evaluation(run.step_to(10 * i), {"loss": value}):
            return i
    return None


def test_early_stopping_stops_where_a_hand_count_says():
    values = [1.0, 0.8, 0.85, 0.79, 0.9, 0.95, 0.8, 0.7]
    # min, patience 3: bests at 1 (1.0), 2 (0.8), 4 (0.79); 5, 6, 7 do not improve: stop at 7
    assert stops(EarlyStopping("loss", patience=3), values) == 7
    # min_delta 0.02: 0.79 is no improvement on 0.8 (needs < 0.78): 3, 4, 5 do not: stop at 5
    assert stops(EarlyStopping("loss", patience=3, min_delta=0.02), values) == 5
    # max: bests at 1 (1.0) only; 2, 3 do not improve: stop at 3 with patience 2
    assert stops(EarlyStopping("eval_loss", patience=2, mode="max"), values) == 3
    # NaN never improves
    assert stops(EarlyStopping("loss", patience=1), [1.0, float("nan")]) == 2
    assert stops(EarlyStopping("loss", patience=3), [3.0, 2.0, 1.0, 0.5]) is None


def test_early_stopping_refuses_what_it_cannot_mean():
    with pytest.raises(ConfigError, match="mode='lowest'.*'min'"):
        EarlyStopping(mode="lowest")
    with pytest.raises(ConfigError, match="patience=-1"):
        EarlyStopping(patience=-1)
    with pytest.raises(ConfigError, match=r"watches 'accuracy'.*\['loss'\].*Fix"):
        EarlyStopping("accuracy").after_evaluation(At().step_to(1), {"loss": 1.0})


def distance_to_step(target):
    """The tiny LM's loss, with a metric whose value is known at every step: |step - target|."""
    def loss(rng, state, params, batch, is_training):
        value, metrics = loss_fn(rng, state, params, batch, is_training)
        return value, {**metrics, "distance": jnp.abs(state.step - target).astype(jnp.float32)}
    return loss


def make_trainer(workdir, loss=loss_fn, verbose=False, tensorboard=False):
    model, params = make_model()
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(workdir), verbose=verbose,
                        run_tensorboard=tensorboard)
    return Trainer(deployer, collate_fn, model.apply, loss, params, optax.sgd(0.05), fsdp=False)


def metrics_by_step(workdir, drop=("time",)):
    """metrics.jsonl as {step: {name: value}} (records of one step merged), each step's records
    counted: a step recorded twice by two runs shows as a count of 2 for its names."""
    by_step, counts = {}, {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step" not in record:
            continue  # a run's start
        step = record.pop("step")
        for name in set(record) - set(drop):
            counts[(step, name)] = counts.get((step, name), 0) + 1
        by_step.setdefault(step, {}).update({k: v for k, v in record.items() if k not in drop})
    return by_step, counts


class Recorder(Callback):
    def __init__(self):
        self.calls = []

    def after_step(self, run):
        self.calls.append(("step", run.trainer.progress.step))

    def after_evaluation(self, run, results):
        self.calls.append(("eval", run.trainer.progress.step, sorted(results)))

    def after_epoch(self, run, epoch, last):
        self.calls.append(("epoch", epoch, last))

    def at_end(self, run):
        self.calls.append(("end",))


@pytest.mark.slow  # 15 s
def test_a_callback_sees_every_step_and_evaluation_and_history_is_metrics_jsonl(tmp_path):
    trainer = make_trainer(tmp_path)
    examples = make_examples(24)  # 4 examples an update (4 data shards): 6 updates an epoch
    recorder = Recorder()
    # 3 epochs, but max_steps ends the run with the second's last update
    history = trainer.fit(examples, 1, 3, eval_examples=examples[:4], eval_every_n_steps=4,
                          log_every_n_steps=3, max_steps=12, callbacks=[recorder])
    names = ["acc", "loss"]
    # every 4 updates (4, 8, 12) and each epoch's end (6, 12: once); the built-in callbacks
    # (saving, evaluating) run before the user's
    assert recorder.calls == (
        [("step", 1), ("step", 2), ("step", 3), ("eval", 4, names), ("step", 4), ("step", 5),
         ("step", 6), ("eval", 6, names), ("epoch", 0, False), ("step", 7), ("eval", 8, names),
         ("step", 8), ("step", 9), ("step", 10), ("step", 11), ("eval", 12, names),
         ("step", 12), ("epoch", 1, True), ("end",)])
    assert isinstance(history, History) and history.stopped_by == "max_steps"
    assert not history.already_complete and history.final_step == 12
    by_step, counts = metrics_by_step(tmp_path)
    assert history.by_step == by_step
    assert set(counts.values()) == {1}
    assert [s for s, _ in history["train_loss"]] == [3, 6, 9, 12]
    assert [s for s, _ in history["eval_loss"]] == [4, 6, 8, 12]
    # the end is saved by default where there is a workdir
    assert os.listdir(tmp_path / "checkpoints" / "steps") == ["12"]
    trainer.deployer.close()


@pytest.mark.slow  # two fits, 20 s
def test_early_stopping_ends_the_run_at_the_hand_counted_step_and_it_stays_ended(tmp_path):
    # the metric is |step - 4|, evaluated every update: best 0 at step 4, then 1, 2: with
    # patience 2 the run stops after the evaluation at step 6, not at its 12th update
    trainer = make_trainer(tmp_path, distance_to_step(4), verbose=True)
    examples = make_examples(48)
    history = trainer.fit(examples, 1, 1, eval_examples=examples[:4], eval_every_n_steps=1,
                          callbacks=[EarlyStopping("eval_distance", patience=2)])
    assert trainer.step == 6
    assert [v for _, v in history["eval_distance"]] == [3, 2, 1, 0, 1, 2]
    assert history.stopped_by.startswith("early stopping: eval_distance has not improved for 2")
    assert os.listdir(tmp_path / "checkpoints" / "steps") == ["6"]
    trainer.deployer.close()

    # the same command again: complete, nothing trained, nothing saved
    again = make_trainer(tmp_path, distance_to_step(4), verbose=True)
    history = again.fit(examples, 1, 1, eval_examples=examples[:4], eval_every_n_steps=1,
                        callbacks=[EarlyStopping("eval_distance", patience=2)])
    assert history.already_complete and history.final_step == 6 and again.step == 6
    assert history.by_step == {}
    again.deployer.close()
    log = (tmp_path / "log.txt").read_text()
    assert "already complete at step 6 (stopped by early stopping: eval_distance" in log
    assert os.listdir(tmp_path / "checkpoints" / "steps") == ["6"]


class Crash(Callback):
    """A kill at ``step``: the process dies after the update, before anything else."""

    def __init__(self, step):
        self.step = step

    def after_step(self, run):
        if run.trainer.progress.step == self.step:
            raise KeyboardInterrupt(f"killed at step {self.step}")


DETERMINISTIC = ("train_loss", "train_acc", "eval_loss", "eval_acc")


@pytest.mark.slow  # four fits, 30 s
def test_a_killed_and_resumed_run_records_each_step_once_as_an_uninterrupted_run(tmp_path):
    examples = make_examples(32)  # 8 updates an epoch, 16 in all
    fit = dict(per_device_batch_size=1, n_epochs=2, eval_examples=examples[:4],
               eval_every_n_steps=4, save_every_n_steps=4, log_every_n_steps=2)

    whole = make_trainer(tmp_path / "whole", tensorboard=True)
    whole.fit(examples, **fit, callbacks=[])
    whole.deployer.close()

    killed = make_trainer(tmp_path / "killed", tensorboard=True)
    with pytest.raises(KeyboardInterrupt):
        killed.fit(examples, **fit, callbacks=[Crash(11)])  # after step 10's records
    killed.deployer.close()
    _, counts = metrics_by_step(tmp_path / "killed")
    assert counts[(10, "train_loss")] == 1  # logged after the checkpoint at step 8
    resumed = make_trainer(tmp_path / "killed", tensorboard=True)
    history = resumed.fit(examples, **fit)
    resumed.deployer.close()
    assert resumed.step == 16 and min(history.by_step) == 10  # resumed at 8, logged from 10 on

    keep = lambda d: {s: {k: v for k, v in r.items() if k in DETERMINISTIC}  # noqa: E731
                      for s, r in d.items()}
    want, want_counts = metrics_by_step(tmp_path / "whole")
    got, got_counts = metrics_by_step(tmp_path / "killed")
    assert set(got_counts.values()) == {1}  # every step once (before: 10's train metrics twice)
    assert keep(got) == keep(want)
    assert set(got_counts) == set(want_counts)

    # TensorBoard: grouped tags; after its purge at the resume, each step once, as in one run
    assert tensorboard_scalars(tmp_path / "killed") == tensorboard_scalars(tmp_path / "whole")

    # a rerun of the complete run trains nothing and says so
    again = make_trainer(tmp_path / "killed", verbose=True)
    history = again.fit(examples, **fit)
    again.deployer.close()
    assert history.already_complete and again.step == 16
    assert "already complete at step 16 (all 2 epochs trained)" in \
        (tmp_path / "killed" / "log.txt").read_text()
    assert metrics_by_step(tmp_path / "killed")[1] == got_counts


def tensorboard_scalars(workdir):
    """{tag: [(step, value), ...]} of the deterministic metrics as TensorBoard shows them: the
    event files read in name order, a START session log at step S dropping what came before at
    S and after (TensorBoard's purge)."""
    from tensorboardX.proto import event_pb2
    events = []
    for name in sorted(os.listdir(workdir / "tensorboard")):
        data = (workdir / "tensorboard" / name).read_bytes()
        i = 0
        while i < len(data):
            length = int.from_bytes(data[i:i + 8], "little")
            events.append(event_pb2.Event.FromString(data[i + 12:i + 12 + length]))
            i += 12 + length + 4
    shown = []
    for event in events:
        if event.HasField("session_log") and \
                event.session_log.status == event_pb2.SessionLog.START:
            shown = [(tag, step, v) for tag, step, v in shown if step < event.step]
        for value in event.summary.value:
            shown.append((value.tag, event.step, value.simple_value))
    tags = {"/".join(name.split("_", 1)) for name in DETERMINISTIC}
    out = {}
    for tag, step, value in shown:
        if tag in tags:
            out.setdefault(tag, []).append((step, value))
    assert set(out) == tags
    return out


def test_a_run_that_does_not_resume_saves_its_end_only_when_asked(tmp_path):
    trainer = make_trainer(tmp_path)
    history = trainer.fit(make_examples(8), 1, 1, resume=False)
    trainer.deployer.close()
    assert history.final_step == 2 and not (tmp_path / "checkpoints").exists()
