"""The built-in callbacks: what ``fit``'s keywords do between steps and at an epoch's end.

Each is a :class:`~redcoast.callbacks.Callback` that sees the :class:`~redcoast.loop.fit_run.FitRun`
(``run.trainer.progress`` says where the run stands) and may save (``run.save()``), evaluate
(``run.evaluate(label)``, which also keeps the best checkpoints and runs the callbacks'
``after_evaluation``) or stop the run (a hook returns a reason). ``fit`` lists them in the order
they run, the user's callbacks after them: a step's or an epoch's checkpoint is written before
the evaluation that follows it, so an evaluation that fails loses no training.
"""

from __future__ import annotations

import jax

from ..callbacks import Callback

Action = Callback  # the built-ins' earlier name


class SaveEveryNSteps(Callback):
    """A checkpoint every ``n`` updates; one that ends an epoch is written at the epoch's end
    (after the evaluation of that step, before the epoch's), so a resume from it starts the
    next epoch instead of running the epoch's end again."""

    def __init__(self, n: int):
        self.n = n

    def after_step(self, run):
        progress = run.trainer.progress
        if progress.step % self.n == 0 and progress.position != run.epoch_updates:
            run.save()

    def after_epoch(self, run, epoch, last):
        if run.trainer.progress.step % self.n == 0:
            run.save()


class EvaluateEveryNSteps(Callback):
    def __init__(self, n: int):
        self.n = n

    def after_step(self, run):
        step = run.trainer.progress.step
        if step % self.n == 0:
            run.evaluate(f"step {step}")


class StopAtMaxSteps(Callback):
    def __init__(self, max_steps: int):
        self.max_steps = max_steps

    def after_step(self, run):
        return "max_steps" if run.trainer.progress.step >= self.max_steps else None


class StopOnSignal(Callback):
    """Stop the epoch once SIGTERM or SIGINT reached any process (checked at every logging
    interval when there are several processes: they must all ask together)."""

    def __init__(self, check_every: int):
        self.check_every = check_every

    def after_step(self, run):
        position = run.trainer.progress.position
        check = (jax.process_count() == 1 or position % self.check_every == 0
                 or position == run.epoch_updates)
        return "signal" if check and run.guard.requested_anywhere() else None


class SaveEveryKEpochs(Callback):
    def __init__(self, k: int):
        self.k = k

    def after_epoch(self, run, epoch, last):
        if (epoch + 1) % self.k == 0:
            run.save()


class SaveLast(Callback):
    """The run's last state, wherever it ends (its last epoch, ``max_steps``, a callback)."""

    def after_epoch(self, run, epoch, last):
        if last:
            run.save()

    def at_stop(self, run, reason):
        run.save()

    def at_end(self, run):
        run.save()


class EvaluateAtEpochEnd(Callback):
    """Evaluate after every epoch and where the run stops inside one (``max_steps``, a
    callback; once per step: a stop at an epoch's end reuses that epoch's evaluation)."""

    def after_epoch(self, run, epoch, last):
        run.evaluate(f"epoch {epoch + 1}{run.schedule.out_of()}")

    def at_stop(self, run, reason):
        run.evaluate(f"step {run.trainer.progress.step} ({reason})")


def fit_actions(save_every_n_steps: int | None, eval_every_n_steps: int | None,
                max_steps: int | None, log_every_n_steps: int,
                save_every_k_epochs: int | None, save_last_ckpt: bool) -> list[Callback]:
    """``fit``'s keywords as callbacks, in the order they run."""
    actions: list[Callback] = []
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
