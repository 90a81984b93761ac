"""Hooks into ``fit``: :class:`Callback`, :class:`EarlyStopping`, and the :class:`History` ``fit``
returns.

A callback's hooks run after each update, after each evaluation, at each epoch's end and at
the run's end (``fit(..., callbacks=[...])``, after the built-in ones of redcoast/loop/actions.py:
saving, evaluating, max_steps, signals). A hook that returns a reason (a short text) stops the
run there: the last checkpoint is saved and the evaluation due at the end runs, as at
``max_steps``, and a rerun of the same command says the run is complete. Each hook gets the
run (:class:`~redcoast.loop.fit_run.FitRun`): ``run.trainer.progress`` (step, epoch, position),
``run.history`` (the metrics logged so far), ``run.save()``, ``run.evaluate(label)`` and
``run.deployer.log_info(text)``. Every process runs the same hooks on the same values, so a
decision to stop is the same everywhere.

A resumed run starts its callbacks afresh (as Keras does): their state is not checkpointed, so
:class:`EarlyStopping` counts its patience from the first evaluation after the resume.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError


class Callback:
    """A no-op at every hook; subclass it and override the hooks you need."""

    def after_step(self, run) -> str | None:
        """After each update (``run.trainer.progress.step`` updates applied); a reason stops
        the run."""
        return None

    def after_evaluation(self, run, results: Mapping[str, Any]) -> str | None:
        """After each evaluation: ``results`` as logged, without the ``eval_`` prefix
        (``{"loss": ..., name: ...}``); a reason stops the run."""
        return None

    def after_epoch(self, run, epoch: int, last: bool) -> str | None:
        """After ``epoch`` (from 0) trained to its end (the trainer's progress is at the next
        epoch's start); ``last``: the run ends after it. A reason stops the run."""
        return None

    def at_stop(self, run, reason: str) -> None:
        """When the run stops inside an epoch or before its last (``reason``: "max_steps" or
        what a hook returned)."""

    def at_end(self, run) -> None:
        """When the run ends, at its schedule's end or stopped (not when a signal stops it)."""


class EarlyStopping(Callback):
    """Stop the run once ``metric`` (an eval result: ``"loss"`` or a key of
    ``eval_metric_fn``'s dict; ``"eval_loss"`` reads the same) has not improved on its best
    for ``patience`` evaluations in a row. ``mode``: ``"min"`` (lower is better) or ``"max"``;
    an improvement is a change of more than ``min_delta``; NaN never improves. Evaluations
    come from ``eval_every_n_steps`` and every epoch's end. A resumed run counts afresh."""

    def __init__(self, metric: str = "loss", patience: int = 3, mode: str = "min",
                 min_delta: float = 0.0):
        if mode not in ("min", "max"):
            raise ConfigError(f"EarlyStopping(mode={mode!r}): it must be 'min' (lower is "
                              "better, e.g. a loss) or 'max' (e.g. accuracy).")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ConfigError(f"EarlyStopping(patience={patience!r}): it must be a "
                              "non-negative integer (evaluations without improvement).")
        if not min_delta >= 0:
            raise ConfigError(f"EarlyStopping(min_delta={min_delta!r}): it must be >= 0.")
        self.metric, self.patience, self.mode, self.min_delta = metric, patience, mode, min_delta
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0  # evaluations since the best

    def after_evaluation(self, run, results):
        name = self.metric
        if name not in results and name.startswith("eval_") and name[5:] in results:
            name = name[5:]
        if name not in results:
            raise ConfigError(f"EarlyStopping watches {self.metric!r}, but the evaluation gave "
                              f"{sorted(results)}. Fix: EarlyStopping(metric=one of those).")
        value, step = float(results[name]), run.trainer.progress.step
        if self._improves(value):
            self.best, self.best_step, self.wait = value, step, 0
            return None
        self.wait += 1
        if self.wait < self.patience:
            return None
        return (f"early stopping: {self.metric} has not improved for {self.wait} evaluation"
                f"{'' if self.wait == 1 else 's'} (best {self.best} at step {self.best_step})")

    def _improves(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta


@dataclasses.dataclass
class History:
    """What one ``fit`` call logged, by step: ``by_step[step]`` holds the ``train_*`` metrics
    of each logging interval and the ``eval_*`` results of each evaluation at that step, as
    ``metrics.jsonl`` records them (a resumed call: from the resume on; the file holds the
    whole run). ``stopped_by``: why the run stopped before its schedule's end ("max_steps" or
    a callback's reason), None otherwise; ``already_complete``: the run was complete at its
    checkpoint, so this call trained nothing (``final_step`` says where it ended)."""

    by_step: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    stopped_by: str | None = None
    already_complete: bool = False
    final_step: int | None = None

    def add(self, metrics: Mapping[str, Any], step: int) -> None:
        self.by_step.setdefault(int(step), {}).update(metrics)

    def __getitem__(self, name: str) -> list[tuple[int, Any]]:
        """``[(step, value), ...]`` of one metric, in the order of the steps."""
        return [(step, values[name]) for step, values in sorted(self.by_step.items())
                if name in values]

    def names(self) -> list[str]:
        return sorted({name for values in self.by_step.values() for name in values})
