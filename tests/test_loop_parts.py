"""The training loop's parts on their own: Progress, EpochData and the between-step actions
(docs/design.md), each against what it must do, without a Trainer."""

import ast
import pathlib

import jax
import numpy as np
import pytest

from redcoast.loop.actions import (EvaluateAtEpochEnd, EvaluateEveryNSteps, SaveEveryKEpochs,
                              SaveEveryNSteps, SaveLast, StopAtMaxSteps, StopOnSignal, fit_actions)
from redcoast.data import EpochData, Stream, epoch_order
from redcoast.errors import DataError
from redcoast.progress import Progress, examples_trained

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "redcoast"


# -- Progress -------------------------------------------------------------------------------

def test_progress_counts_updates_and_examples_and_starts_each_epoch_at_zero():
    p = Progress().after_update(16).after_update(16)
    assert (p.step, p.epoch, p.position, p.examples) == (2, 0, 2, 32)
    p = p.next_epoch().after_update(8)
    assert (p.step, p.epoch, p.position, p.examples) == (3, 1, 1, 8)
    assert p.with_best("best_min_loss", 0.5).best == {"best_min_loss": 0.5} and p.best == {}


def test_progress_round_trips_through_a_checkpoint_record():
    keys = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
    p = Progress(step=7, epoch=1, position=3, examples=48, best={"best_max_acc": 0.9},
                 train_key=keys[0], eval_key=keys[1])
    meta = p.to_meta(np.asarray)
    back = Progress.from_meta(meta, examples_trained(meta, 16, warn=None), lambda k: k)
    assert (back.step, back.epoch, back.position, back.examples, dict(back.best)) == \
        (7, 1, 3, 48, {"best_max_acc": 0.9})
    np.testing.assert_array_equal(back.train_key, keys[0])
    np.testing.assert_array_equal(back.eval_key, keys[1])


def test_a_record_of_the_earlier_format_counts_updates_of_the_recorded_size_or_says_it_guesses():
    said = []
    old = {"step": 5, "epoch": 1, "position": 2, "config": {"global_batch_size": 8,
                                                             "accumulate_grad_batches": 2}}
    assert examples_trained(old, per_update=4, warn=said.append) == 32 and not said
    old["config"] = {}
    assert examples_trained(old, per_update=4, warn=said.append) == 8
    assert "does not record how many examples" in said[0] and "Fix:" in said[0]


# -- EpochData: one path for sequences and streams ------------------------------------------

def test_a_sequence_is_handed_out_in_its_epoch_order_an_update_at_a_time():
    rows = list(range(10))
    data = EpochData(rows, seed=0, epoch=3)
    order = epoch_order(10, 0, 3)
    examples, first = data.first(4)
    assert examples is rows and first.tolist() == order[:4].tolist()
    assert data.skip_trained(3, per_update=3, epoch=3) == 2  # 7 left: 2 updates of 3
    updates = [idx.tolist() for _, idx in data.updates(3)]
    assert updates == [order[3:6].tolist(), order[6:9].tolist()] and data.leftover == 1


def test_a_stream_is_handed_out_as_it_comes_and_its_head_is_kept():
    data = EpochData(iter(range(10)), seed=0, epoch=0)
    head, idx = data.first(4)
    assert head == [0, 1, 2, 3] and idx.tolist() == [0, 1, 2, 3]
    assert data.length is None and data.skip_trained(3, per_update=3, epoch=0) is None
    groups = [[examples[i] for i in idx] for examples, idx in data.updates(3)]
    assert groups == [[3, 4, 5], [6, 7, 8]] and data.leftover == 1


def test_skipping_more_than_an_epoch_holds_is_an_error_naming_the_fix():
    with pytest.raises(DataError, match="12 of them were trained.*Fix: give the same examples"):
        EpochData(list(range(10)), 0, 0).skip_trained(12, 2, 0)
    with pytest.raises(DataError, match="ended after 10 examples.*Fix:"):
        EpochData(iter(range(10)), 0, 0).skip_trained(12, 2, 0)


def test_a_stream_giving_other_examples_than_the_checkpoint_recorded_is_refused():
    recorded = Stream(iter(range(10)))
    recorded.skip(4)
    with pytest.raises(DataError, match="fingerprint differs"):
        EpochData(iter(range(1, 11)), 0, 0).skip_trained(4, 2, 0, recorded.fingerprint(4))
    EpochData(iter(range(10)), 0, 0).skip_trained(4, 2, 0, recorded.fingerprint(4))  # the same


# -- actions ---------------------------------------------------------------------------------

class FakeRun:
    """What actions see of a FitRun: where the trainer stands, and what they asked for."""

    class Trainer:
        progress = Progress()

    class Schedule:
        @staticmethod
        def out_of():
            return "/3"

    class Guard:
        requested = False

        def requested_anywhere(self):
            return self.requested

    def __init__(self):
        self.trainer, self.schedule, self.guard = self.Trainer(), self.Schedule(), self.Guard()
        self.epoch_updates, self.calls = 4, []

    def at(self, step, position=0):
        self.trainer.progress = Progress(step=step, position=position)
        return self

    def save(self):
        self.calls.append(("save", self.trainer.progress.step))

    def evaluate(self, label):
        self.calls.append(("evaluate", label))


def test_step_actions_save_evaluate_and_stop_at_their_steps():
    run = FakeRun()
    actions = [SaveEveryNSteps(2), EvaluateEveryNSteps(3), StopAtMaxSteps(4)]
    reasons = [[a.after_step(run.at(step)) for a in actions] for step in range(1, 5)]
    assert run.calls == [("save", 2), ("evaluate", "step 3"), ("save", 4)]
    assert [r[2] for r in reasons] == [None, None, None, "max_steps"]


def test_a_signal_is_acted_on_at_once_on_one_process():
    run, stop = FakeRun(), StopOnSignal(check_every=10)
    assert stop.after_step(run.at(1, position=1)) is None
    run.guard.requested = True
    assert stop.after_step(run.at(2, position=2)) == "signal"


def test_epoch_actions_save_every_k_and_the_last_then_evaluate():
    run = FakeRun()
    actions = [SaveEveryKEpochs(2), SaveLast(), EvaluateAtEpochEnd()]
    for epoch in range(3):
        run.at(4 * (epoch + 1))
        for action in actions:
            action.after_epoch(run, epoch, last=epoch == 2)
    assert run.calls == [("evaluate", "epoch 1/3"), ("save", 8), ("evaluate", "epoch 2/3"),
                         ("save", 12), ("evaluate", "epoch 3/3")]
    run.calls.clear()
    for action in actions:
        action.at_stop(run.at(13, position=1), "max_steps")
    assert run.calls == [("save", 13), ("evaluate", "step 13 (max_steps)")]


def test_fit_saves_before_it_evaluates_at_a_step_and_at_an_epoch_end():
    run = FakeRun()  # 4 updates an epoch
    actions = fit_actions(save_every_n_steps=2, eval_every_n_steps=2, max_steps=None,
                          log_every_n_steps=1, save_every_k_epochs=1, save_last_ckpt=False)
    for action in actions:
        action.after_step(run.at(2, position=2))
    assert run.calls == [("save", 2), ("evaluate", "step 2")]
    run.calls.clear()
    # the epoch's last update: its step's checkpoint is written at the epoch's end (a resume
    # from it starts the next epoch), after that step's evaluation, before the epoch's
    for action in actions:
        action.after_step(run.at(4, position=4))
    run.at(4)  # the trainer's progress is at the next epoch's start
    for action in actions:
        action.after_epoch(run, 0, last=False)
    assert run.calls == [("evaluate", "step 4"), ("save", 4), ("save", 4),
                         ("evaluate", "epoch 1/3")]


# -- the package's shape ---------------------------------------------------------------------

def _core_modules():
    return [p for p in PACKAGE.rglob("*.py") if "compat" not in p.relative_to(PACKAGE).parts
            and p.name != "__init__.py"]


def test_the_core_never_imports_from_compat():
    for path in _core_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "compat" not in (node.module or "").split("."), f"{path}: {ast.dump(node)}"


PUBLIC_WITH_UNDERSCORE = {"os._exit"}  # the standard library's, documented


def test_the_core_never_reads_or_writes_a_private_attribute_of_another_object():
    for path in _core_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                owner = node.value
                if ast.unparse(node) in PUBLIC_WITH_UNDERSCORE:
                    continue
                assert isinstance(owner, ast.Name) and owner.id in ("self", "cls"), \
                    f"{path}:{node.lineno}: .{node.attr} of {ast.unparse(owner)}"
