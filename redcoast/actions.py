"""What ``fit`` does between steps and at an epoch's end, one small class per keyword.

Each action sees the :class:`~redcoast.fit_run.FitRun` (``run.trainer.progress`` says where the
run stands) and may save (``run.save()``), evaluate (``run.evaluate(label)``, which also keeps
the best checkpoints) or stop the epoch (``after_step`` returns a reason). ``fit`` lists them in
the order they run: a step's or an epoch's checkpoint is written before the evaluation that
follows it, so an evaluation that fails loses no training.

To add one (say, evaluate every N steps and keep the best by BLEU), subclass :class:`Action`
and override the hooks it needs.
"""

from __future__ import annotations

import jax


class Action:
    """A no-op at every hook."""

    def after_step(self, run) -> str | None:
        """After each update; a reason ("max_steps", "signal") stops the epoch there."""
        return None

    def after_epoch(self, run, epoch: int, last: bool) -> None:
        """After ``epoch`` trained to its end (the trainer's progress is at the next epoch's
        start); ``last``: the run ends after it."""

    def at_max_steps(self, run) -> None:
        """When ``max_steps`` stopped the run inside an epoch."""

    def at_end(self, run) -> None:
        """When the run ends normally."""


class SaveEveryNSteps(Action):
    def __init__(self, n: int):
        self.n = n

    def after_step(self, run):
        if run.trainer.progress.step % self.n == 0:
            run.save()


class EvaluateEveryNSteps(Action):
    def __init__(self, n: int):
        self.n = n

    def after_step(self, run):
        step = run.trainer.progress.step
        if step % self.n == 0:
            run.evaluate(f"step {step}")


class StopAtMaxSteps(Action):
    def __init__(self, max_steps: int):
        self.max_steps = max_steps

    def after_step(self, run):
        return "max_steps" if run.trainer.progress.step >= self.max_steps else None


class StopOnSignal(Action):
    """Stop the epoch once SIGTERM or SIGINT reached any process (checked at every logging
    interval when there are several processes: they must all ask together)."""

    def __init__(self, check_every: int):
        self.check_every = check_every

    def after_step(self, run):
        position = run.trainer.progress.position
        check = (jax.process_count() == 1 or position % self.check_every == 0
                 or position == run.epoch_updates)
        return "signal" if check and run.guard.requested_anywhere() else None


class SaveEveryKEpochs(Action):
    def __init__(self, k: int):
        self.k = k

    def after_epoch(self, run, epoch, last):
        if (epoch + 1) % self.k == 0:
            run.save()


class SaveLast(Action):
    """The run's last state, wherever it ends (its last epoch, ``max_steps``)."""

    def after_epoch(self, run, epoch, last):
        if last:
            run.save()

    def at_max_steps(self, run):
        run.save()

    def at_end(self, run):
        run.save()


class EvaluateAtEpochEnd(Action):
    """Evaluate after every epoch and where ``max_steps`` stops the run."""

    def after_epoch(self, run, epoch, last):
        run.evaluate(f"epoch {epoch + 1}{run.schedule.out_of()}")

    def at_max_steps(self, run):
        run.evaluate(f"step {run.trainer.progress.step} (max_steps)")


def fit_actions(save_every_n_steps: int | None, eval_every_n_steps: int | None,
                max_steps: int | None, log_every_n_steps: int,
                save_every_k_epochs: int | None, save_last_ckpt: bool) -> list[Action]:
    """``fit``'s keywords as actions, in the order they run."""
    actions: list[Action] = []
    if save_every_n_steps:
        actions.append(SaveEveryNSteps(save_every_n_steps))
    if eval_every_n_steps:
        actions.append(EvaluateEveryNSteps(eval_every_n_steps))
    if max_steps is not None:
        actions.append(StopAtMaxSteps(max_steps))
    actions.append(StopOnSignal(log_every_n_steps))
    if save_every_k_epochs:
        actions.append(SaveEveryKEpochs(save_every_k_epochs))
    if save_last_ckpt:
        actions.append(SaveLast())
    actions.append(EvaluateAtEpochEnd())
    return actions
