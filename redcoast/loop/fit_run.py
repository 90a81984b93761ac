"""One ``Trainer.fit`` run: its checkpoint store, its evaluation, and the epochs it trains.

``Trainer.fit`` turns its keywords into a :class:`FitRun` and a list of callbacks (the built-in
ones of redcoast/loop/actions.py, then the user's: redcoast/callbacks.py) and calls
:meth:`FitRun.train`. The run reads and moves the trainer only
through its public methods (``train``, ``evaluate``, ``save_checkpoint``, ``restore_checkpoint``,
``progress`` / ``set_progress``); where it stands is the trainer's :class:`~redcoast.progress.Progress`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..callbacks import History
from ..data import EpochData, examples_by_epoch, is_iterator, is_sequence, updates_after
from ..errors import ConfigError, EvaluationError
from ..store.checkpoint import CheckpointStore
from ..store.workdir import WorkdirLock, agree, move_aside
from .preemption import PreemptionGuard
from .resume_changes import lr_at, planned_updates, warn_if_changed


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What ``fit`` evaluates: the loss over ``examples`` (``loss``) and/or ``predictor``'s
    predictions scored by ``metric_fn(examples, predictions) -> dict``."""

    examples: Sequence | None
    per_device_batch_size: int
    loss: bool = True
    predictor: Any = None
    metric_fn: Callable | None = None

    def results(self, trainer, label: str, saved_note: Callable[[], str]) -> dict:
        """The eval results after ``label`` (logged); an error in any part is raised as an
        :class:`EvaluationError` naming that part and ``saved_note()`` (what is saved)."""
        results: dict = {}
        if self.examples is None:
            return results
        part = "the eval loss (collate_fn or loss_fn with is_training=False)"
        try:
            if self.loss:
                results.update(trainer.evaluate(self.examples, self.per_device_batch_size))
            if self.predictor is not None:
                part = "eval_predictor (collate_fn, pred_fn or output_fn)"
                preds = self.predictor.predict(self.examples, self.per_device_batch_size,
                                               params=trainer.params)
                if self.metric_fn is not None:
                    part = "eval_metric_fn"
                    metrics = self.metric_fn(self.examples, preds)
                    if not isinstance(metrics, Mapping):
                        raise ConfigError(
                            f"eval_metric_fn returned {type(metrics).__name__} ({metrics!r:.60}); "
                            "it must return a dict of named results, e.g. {'accuracy': 0.93}, as "
                            "redco's did. Fix: return a dict from eval_metric_fn.")
                    results.update(metrics)
        except Exception as e:
            note = saved_note()
            raise EvaluationError(f"the evaluation after {label} failed in {part}: "
                                  f"{type(e).__name__}: {e}" + (f"; {note}" if note else "")) from e
        if results:
            shown = ", ".join(f"{k} = {v:.4f}" if isinstance(v, float) else f"{k} = {v}"
                              for k, v in results.items())
            trainer.deployer.log_info(f"{label}: eval {shown}")
            trainer.deployer.log_metrics({f"eval_{k}": v for k, v in results.items()},
                                         trainer.progress.step)
        return results


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How long ``fit`` trains and on what: ``examples_of(epoch)`` (a sequence or a
    :class:`~redcoast.data.Stream`), ``n_epochs`` (None: until ``max_steps``), the batch size."""

    examples_of: Callable[[int], Any]
    n_epochs: int | None
    max_steps: int | None
    per_device_batch_size: int
    per_update: int
    shuffle: bool
    fixed: bool  # the same sequence every epoch (its leftover is said once, not every epoch)
    train_size: int | None  # of the first epoch; None: a stream
    one_shot: str | None  # the type of a one-shot iterator given as train_examples
    log_every_n_steps: int
    check_layout: bool

    @property
    def streamed(self) -> bool:
        return self.train_size is None

    @classmethod
    def of(cls, examples_of, first: EpochData, train_examples, n_epochs, max_steps,
           per_device_batch_size, per_update, shuffle, log_every_n_steps, check_layout,
           log_info) -> Schedule:
        fixed = is_sequence(train_examples)  # the same examples every epoch
        if fixed and first.length % per_update:  # said once, not every epoch
            log_info(f"each epoch trains on {first.length // per_update * per_update} of the "
                     f"{first.length} examples: the last {first.length % per_update} of its order "
                     f"(shuffled anew each epoch) do not fill an update of {per_update} and are "
                     "left out.")
        one_shot = type(train_examples).__name__ if is_iterator(train_examples) else None
        return cls(examples_of, n_epochs, max_steps, per_device_batch_size, per_update, shuffle,
                   fixed, first.length, one_shot, log_every_n_steps, check_layout)

    def epochs(self, start: int):
        return range(start, self.n_epochs) if self.n_epochs is not None else itertools.count(start)

    def out_of(self) -> str:
        """``"/n_epochs"`` (nothing when the run ends at max_steps), for labels."""
        return f"/{self.n_epochs}" if self.n_epochs is not None else ""


def epochs_of(train_examples, n_epochs, max_steps, shuffle, first_epoch, deployer):
    """``(examples_of, n_epochs, first)``: ``train_examples`` as a function of the epoch
    (data.examples_by_epoch), the epochs to train (one pass for a one-shot iterator, said in
    the log) and the first epoch's :class:`EpochData`; what cannot run is refused now."""
    one_shot = type(train_examples).__name__ if is_iterator(train_examples) else None
    examples_of = examples_by_epoch(train_examples)  # epoch -> a sequence or a Stream
    first = EpochData(examples_of(first_epoch), deployer.jax_seed, 0, shuffle)
    if first.endless and max_steps is None:
        raise ConfigError("train_examples never ends, so its first epoch would never end. Fix: "
                          "pass max_steps=... (the number of updates to train for).")
    if one_shot and max_steps is None and n_epochs > 1:
        raise ConfigError(
            f"train_examples is an iterator ({one_shot}), which can be read once, but "
            f"n_epochs={n_epochs}. Fix: pass a function returning a fresh iterator each epoch "
            "(e.g. `lambda epoch: my_generator(epoch)`), a re-iterable (a list, a "
            "datasets.IterableDataset), or n_epochs=1.")
    if one_shot and not first.endless and (n_epochs is None or n_epochs > 1):
        # read once, so its one pass is the run's last epoch: saved and evaluated as such,
        # not an error at the start of a second epoch after the first went unsaved
        deployer.log_warning(
            f"train_examples is an iterator ({one_shot}), which can be read once: this run "
            f"trains one pass over it (n_epochs={n_epochs} and max_steps={max_steps} "
            "notwithstanding), stopping where it ends or at max_steps. Fix, for more: pass a "
            "function returning a fresh iterator each epoch (e.g. `lambda epoch: "
            "my_generator(epoch)`) or a re-iterable.")
        n_epochs = first_epoch + 1
    return examples_of, n_epochs, first


class FitRun:
    """The checkpoint store (and workdir lock) of one ``fit``, what it saved, its evaluations
    and the epochs it trains. A context manager: leaving it finishes the saves under way and
    releases the lock, whatever happened."""

    def __init__(self, trainer, schedule: Schedule, evaluation: Evaluation, actions: list,
                 keep_best: Sequence[tuple[str, Callable]] = (),
                 files: Mapping[str, str] | None = None):
        self.trainer, self.schedule, self.evaluation = trainer, schedule, evaluation
        self.actions, self.keep_best_by = actions, list(keep_best)  # the callbacks, in order
        self.history = History()  # what this fit logs (the deployer's logger reports it)
        self.files = dict(files or {})  # {name: text} kept in every checkpoint (run.yaml)
        self.deployer = trainer.deployer
        layout = trainer.layout
        # what a checkpoint records of the run, for a resume to compare
        self.config = {
            "jax_seed": self.deployer.jax_seed, "n_model_shards": layout.n_model_shards,
            "n_data_shards": layout.n_data_shards, "n_processes": jax.process_count(),
            "global_batch_size": trainer.global_batch_size(schedule.per_device_batch_size),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "train_size": schedule.train_size, "n_epochs": schedule.n_epochs,
            "max_steps": schedule.max_steps, "shuffle": schedule.shuffle,
            "compute_dtype": str(jnp.dtype(trainer.compute_dtype)),
            "planned_updates": planned_updates(schedule.train_size, schedule.n_epochs,
                                               schedule.max_steps, schedule.per_update)}
        self.workdir = self.deployer.workdir
        self.store: CheckpointStore | None = None
        self._lock: WorkdirLock | None = None
        # (step, epoch, position, directory) of the newest checkpoint on disk, if any
        self.saved: tuple | None = None
        self.resumed = False  # from a checkpoint of the store
        self._evaluated: dict = {}  # step -> eval results (one evaluation per step)
        self.source: EpochData | None = None  # the epoch under way
        self.epoch_updates: int | None = None  # its updates (None for a stream: unknown)
        self.guard = PreemptionGuard()
        self.stop_reason: str | None = None  # why the epoch under way stopped early
        self.stop_requested: str | None = None  # a reason an evaluation's callback gave
        self.stopped_by: str | None = None  # why the run stopped before its schedule's end
        self.resumed_meta: Mapping | None = None  # the checkpoint's record, when resumed
        self.resumed_fingerprint: str | None = None  # of the stream's examples before the checkpoint

    # ------------------------------------------------------------------ store and resume

    def open(self, keep_last_n_ckpts: int | None, resume: bool, wants_saving: bool) -> FitRun:
        """Take the workdir (lock) and its checkpoint store where saving or resuming needs them;
        with ``resume=False`` an earlier run's checkpoints are moved aside, never overwritten."""
        if self.workdir is None or not (wants_saving or resume):
            return self
        self._lock = WorkdirLock(self.workdir, logger=self.deployer.logger).acquire()
        try:
            directory = os.path.join(self.workdir, "checkpoints")
            self.store = self._new_store(directory, keep_last_n_ckpts)
            # process 0 decides (the others might look after it moved the directory)
            if not resume and agree(self.store.steps() or _has_best(directory)):
                self.store.close()
                aside = move_aside(directory, "earlier-run", self.deployer.logger)
                self.deployer.log_warning(
                    f"resume=False: the checkpoints of an earlier run in {directory} were moved "
                    f"to {aside}; this run starts afresh.")
                self.store = self._new_store(directory, keep_last_n_ckpts)
        except BaseException:
            self.close()
            raise
        return self

    def _new_store(self, directory, keep_last_n_ckpts):
        return CheckpointStore(os.path.join(directory, "steps"), keep_last_n=keep_last_n_ckpts,
                               logger=self.deployer.logger, files=self.files)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self._lock is not None:
            self._lock.release()

    def __enter__(self) -> FitRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def resume(self) -> None:
        """Continue from the newest checkpoint where the store has one (said in the log)."""
        trainer, per_update = self.trainer, self.schedule.per_update
        if self.store is None or not self.store.steps():
            return
        meta = trainer.restore_checkpoint(self.store, per_update=per_update)
        if meta is None:
            return
        self.resumed, self.resumed_fingerprint = True, meta.get("stream_fingerprint")
        self.resumed_meta = meta
        progress = trainer.progress
        # what the interrupted run logged after its checkpoint is trained and logged again
        self.deployer.logger.rewind(progress.step)
        trainer.set_progress(progress.replace(best={**progress.best, **self._best_on_disk()}))
        self.saved = (progress.step, progress.epoch, progress.position, self.store.directory)
        warn_if_changed(self.deployer, meta.get("config", {}), self.config,
                        trainer.lr_schedule_fn, progress.step)
        into = f"{progress.position} update{'' if progress.position == 1 else 's'} into it"
        if progress.examples:
            resumed = None if self.schedule.streamed else self.schedule.examples_of(progress.epoch)
            listed = resumed is not None and is_sequence(resumed)
            into += (f": its first {progress.examples} examples"
                     f"{' (in its order)' if listed else ''} were trained before the "
                     "checkpoint and are skipped")
            if resumed is not None and listed:
                left = updates_after(len(resumed), progress.examples, per_update, progress.epoch)
                into += f"; {left} updates of {per_update} remain"
        self.deployer.log_info(f"resumed from {self.store.directory}/{meta['step']}: step "
                               f"{meta['step']}, epoch {progress.epoch + 1}, {into}")
        if self.schedule.one_shot and progress.examples:
            self.deployer.log_warning(
                f"train_examples is an iterator ({self.schedule.one_shot}), which cannot be "
                f"rewound: resuming skips the first {progress.examples} examples it gives, as the "
                "interrupted run trained on those; that is right only if it starts where that "
                "run's started. Fix: pass a function returning a fresh iterator (`lambda epoch: "
                "my_generator(epoch)`, or one with no argument) or a re-iterable (a "
                "datasets.IterableDataset).")

    def complete(self) -> str | None:
        """Why the run is already complete where it stands (its schedule's end, or a stop a
        callback asked for recorded in the checkpoint it resumed from, under the same
        schedule), or None."""
        step, schedule = self.trainer.progress.step, self.schedule
        if schedule.max_steps is not None and step >= schedule.max_steps:
            return f"max_steps={schedule.max_steps} reached"
        if schedule.n_epochs is not None and self.trainer.progress.epoch >= schedule.n_epochs:
            return f"all {schedule.n_epochs} epochs trained"
        stopped = self._stop_on_disk() if self.resumed else None
        if agree(stopped is not None and stopped.get("step") == step
                 and all(stopped.get(k) == self.config[k] for k in ("n_epochs", "max_steps"))):
            return f"stopped by {stopped['reason'] if stopped else 'a callback'}"
        return None

    def _stop_on_disk(self) -> dict | None:
        """The stop a callback asked for (:meth:`_record_stop`), if one is recorded."""
        from etils import epath
        path = epath.Path(self.workdir) / "checkpoints" / STOPPED
        try:
            return json.loads(path.read_text()) if path.exists() else None
        except (OSError, ValueError):  # unreadable: not complete, the run trains on (said)
            self.deployer.log_warning(f"{path} is unreadable, so the stop it recorded is not "
                                      "known; the run trains on from its checkpoint.")
            return None

    def _record_stop(self, reason: str) -> None:
        """Write down (process 0, beside the checkpoints) that a callback ended the run at this
        step, for a rerun to find it complete."""
        if self.store is None or jax.process_index() != 0:
            return
        from etils import epath
        record = {"step": self.trainer.progress.step, "reason": reason,
                  "n_epochs": self.config["n_epochs"], "max_steps": self.config["max_steps"]}
        directory = epath.Path(self.workdir) / "checkpoints"
        (directory / (STOPPED + ".tmp")).write_text(json.dumps(record))
        (directory / (STOPPED + ".tmp")).rename(directory / STOPPED)

    def _best_on_disk(self) -> dict:
        """``{tag: value}`` of the best checkpoints kept in the workdir: a step's checkpoint is
        written before its evaluation, so its record may not hold the best that evaluation kept."""
        from etils import epath
        directory = epath.Path(self.workdir) / "checkpoints"
        best = {}
        for path in sorted(directory.iterdir()) if directory.exists() else []:
            if not path.name.startswith("best_"):
                continue
            best_store = CheckpointStore(str(path), logger=self.deployer.logger)
            meta = best_store.latest_meta()
            best_store.close()
            if meta is not None and path.name in meta.get("best", {}):
                best[path.name] = meta["best"][path.name]
        return best

    # ------------------------------------------------------------------ what actions call

    def save(self) -> None:
        """Checkpoint the trainer where it stands (a resume starts there)."""
        if self.store is None:
            return
        progress = self.trainer.progress
        self.trainer.save_checkpoint(self.store, progress.epoch, progress.position,
                                     self.config_at(progress.step),
                                     examples_consumed=progress.examples,
                                     stream_fingerprint=self._fingerprint(progress.examples))
        self.saved = (progress.step, progress.epoch, progress.position, self.store.directory)

    def config_at(self, step: int) -> dict:
        """What a checkpoint at ``step`` records of the run: :attr:`config`, and the learning
        rate at the first update, this one and the planned last (a resume compares them)."""
        ends = [0, step] + [n for n in (self.config["planned_updates"],) if n is not None]
        return {**self.config, "lr_at": lr_at(self.trainer.lr_schedule_fn, ends)}

    def _fingerprint(self, n):
        return None if self.source is None else self.source.fingerprint(n)

    def evaluate(self, label: str) -> dict:
        """The eval results after ``label``, evaluated once per step; the best checkpoints by
        them kept; each callback's ``after_evaluation`` run on new results (a reason it gives
        stops the run after the hook under way)."""
        step = self.trainer.progress.step
        fresh = step not in self._evaluated
        if fresh:
            self._evaluated.clear()
            self._evaluated[step] = self.evaluation.results(self.trainer, label, self.saved_note)
        results = self._evaluated[step]
        self._keep_best(results)
        if fresh and results:
            for callback in self.actions:
                reason = callback.after_evaluation(self, results)
                self.stop_requested = self.stop_requested or reason
        return results

    def _keep_best(self, results: Mapping) -> None:
        """Save a checkpoint under ``best_<min|max>_<name>`` where ``results`` beats the best."""
        trainer = self.trainer
        for name, better in self.keep_best_by:
            if name not in results:
                raise ConfigError(f"Cannot keep the best checkpoint by '{name}': the evaluation "
                                  f"gave {sorted(results)}. Fix: name one of those.")
            value, tag = float(results[name]), f"best_{better.__name__}_{name}"
            best = trainer.progress.best
            if math.isnan(value) or (tag in best and better(value, best[tag]) == best[tag]):
                continue
            trainer.set_progress(trainer.progress.with_best(tag, value))
            best_store = CheckpointStore(os.path.join(self.workdir, "checkpoints", tag),
                                         keep_last_n=1, logger=self.deployer.logger,
                                         replace_existing=True, files=self.files)
            progress = trainer.progress
            trainer.save_checkpoint(best_store, progress.epoch, progress.position,
                                    self.config_at(progress.step),
                                    examples_consumed=progress.examples)
            best_store.close()
            self.deployer.log_info(f"saved the best checkpoint by {name} = {value:.4f} "
                                   f"(step {progress.step}) in {best_store.directory}")

    def stop_for_signal(self) -> None:
        """Save where the run stands and exit; without a store, exit with a failure status."""
        guard, step = self.guard, self.trainer.progress.step
        by = guard.signal_name or "a signal on another process"
        if self.store is not None:
            self.save()
            self.store.wait()
            self.deployer.log_info(f"stopped by {by}: saved a checkpoint at step {step} in "
                                   f"{self.store.directory}. Run the same command again to continue.")
            raise SystemExit(0)
        # nothing to continue from: a failure status (128 + the signal, as a shell reports it)
        self.deployer.log_warning(
            f"stopped by {by} after step {step}: the Deployer has no workdir, so nothing was "
            "saved and running again starts from the beginning. Fix: Deployer(..., "
            "workdir='...') to resume.")
        raise SystemExit(128 + signal.Signals[guard.signal_name].value if guard.signal_name else 1)

    def saved_note(self) -> str:
        """What is on disk for a rerun to resume from (said when an evaluation fails)."""
        step_now = self.trainer.progress.step
        if self.store is None:
            how = ("pass workdir=... to Deployer" if self.workdir is None else
                   "pass save_every_k_epochs=1 (or save_every_n_steps=...) to fit")
            return (f"no checkpoint was saved, so a rerun starts afresh. Fix: correct it, and "
                    f"{how} to keep the training done before an evaluation.")
        if self.saved is None:
            return ("no checkpoint has been saved in this run, so a rerun starts afresh (fit "
                    "saves every save_every_k_epochs epochs and every save_every_n_steps updates, "
                    "before evaluating). Fix: correct it and run again.")
        step, epoch, position, directory = self.saved
        if step == step_now:
            what = f"epoch {epoch}" if position == 0 else f"step {step}"
            return (f"{what} is saved at {directory}/{step} and a rerun resumes from there. "
                    "Fix: correct it and run the same command again.")
        return (f"the newest checkpoint is {directory}/{step} (step {step}): a rerun resumes "
                f"from there and trains the {step_now - step} updates since again. Fix: "
                "correct it and run the same command again.")

    # ------------------------------------------------------------------ the epochs

    def train(self) -> None:
        """Train from where the trainer stands to the end of the schedule, running the actions
        between steps and at each epoch's end; stop-and-save on SIGTERM/SIGINT."""
        trainer, schedule = self.trainer, self.schedule
        if not self.resumed:  # from the start of the trainer's epoch
            trainer.set_progress(trainer.progress.replace(position=0, examples=0))
        start = trainer.progress
        with self.guard:
            for epoch in schedule.epochs(start.epoch):
                if schedule.max_steps is not None and trainer.progress.step >= schedule.max_steps:
                    break  # resumed at the end
                resumed = start if epoch == start.epoch else None
                reason, finished = self._train_epoch(epoch, resumed)
                if reason == "signal" and not finished:
                    self.stop_for_signal()
                stop = reason if reason != "signal" else None
                if finished:
                    last = stop is not None or epoch + 1 == schedule.n_epochs
                    trainer.set_progress(trainer.progress.next_epoch())
                    for callback in self.actions:  # every one: the last save among them
                        asked = callback.after_epoch(self, epoch, last)
                        stop = stop or asked or self.stop_requested
                    if stop is not None and not last:  # a callback ended the run here
                        self._at_stop(stop)
                elif stop is not None:
                    self._at_stop(stop)
                if stop is not None:
                    self.stopped_by = self.stopped_by or stop
                    break
                if self.guard.requested_anywhere():
                    self.stop_for_signal()
            for callback in self.actions:
                callback.at_end(self)

    def _at_stop(self, reason: str) -> None:
        """The run ends before its schedule's end: recorded (a checkpoint written from now
        on says so), then each callback's ``at_stop`` (the last save and evaluation)."""
        self.stopped_by = reason
        if reason != "max_steps":  # the schedule's own end needs no record
            self.deployer.log_info(f"stopped at step {self.trainer.progress.step}: {reason}")
        for callback in self.actions:
            callback.at_stop(self, reason)
        if reason != "max_steps":  # after the last save: a rerun resumes from it, complete
            self._record_stop(reason)

    def _train_epoch(self, epoch: int, resumed) -> tuple[str | None, bool]:
        """Train ``epoch`` (from ``resumed``, a Progress inside it, or from its start): why it
        stopped early (None, "max_steps" or "signal") and whether it reached its end."""
        trainer, schedule, per_update = self.trainer, self.schedule, self.schedule.per_update
        position, skip = (resumed.position, resumed.examples) if resumed else (0, 0)
        examples = schedule.examples_of(epoch)
        self.source = EpochData(examples, self.deployer.jax_seed, epoch, schedule.shuffle)
        if self.source.length is None:
            self.epoch_updates = None
        else:
            trainer.updates_per_epoch(self.source.length, schedule.per_device_batch_size)  # one fits
            self.epoch_updates = position + updates_after(self.source.length, skip, per_update, epoch)
        self.stop_reason = None
        if self.epoch_updates is None or position < self.epoch_updates:
            trainer.train(self.source, schedule.per_device_batch_size,
                          desc=f"epoch {epoch + 1}{schedule.out_of()}", epoch=epoch,
                          log_every_n_steps=schedule.log_every_n_steps, start_position=position,
                          after_step=self._after_step, start_example=skip,
                          check_layout=schedule.check_layout,
                          start_fingerprint=self.resumed_fingerprint if resumed else None)
        # a stream's end is known only once read: stopped early, it may hold more
        finished = self.stop_reason is None or trainer.progress.position == self.epoch_updates
        if finished:
            self._say_leftover(epoch, skip)
        return self.stop_reason, finished

    def _after_step(self, position: int) -> bool:
        reason = None
        for callback in self.actions:  # every one sees the step; the first reason stops
            asked = callback.after_step(self)
            reason = reason or asked or self.stop_requested
        self.stop_reason = reason
        return reason is not None

    def _say_leftover(self, epoch: int, skip: int) -> None:
        per_update, source = self.schedule.per_update, self.source
        assert source is not None  # set by _train_epoch
        # resumed at an example that is not a multiple of the update: said anew
        anew = skip % per_update != 0
        left = (source.leftover if source.length is None else
                0 if self.schedule.fixed and not anew else (source.length - skip) % per_update)
        if left:
            self.deployer.log_info(f"epoch {epoch + 1}: its last {left} examples do not fill an "
                                   f"update of {per_update} and were left out.")


STOPPED = "stopped.json"  # beside the checkpoints: a callback ended the run (FitRun._record_stop)


def _has_best(directory) -> bool:
    from etils import epath
    path = epath.Path(directory)
    return path.exists() and any(p.name.startswith("best_") for p in path.iterdir())

