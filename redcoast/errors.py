"""Errors a user can cause, each carrying a message that names the cause and the fix."""

import math


class RedcoastError(Exception):
    """Base class of every error redcoast raises on purpose."""


class ConfigError(RedcoastError, ValueError):
    """The run's configuration cannot work (devices, batch sizes, shards, rules)."""


class DataError(RedcoastError, ValueError):
    """The output of ``collate_fn`` (or of ``pred_fn``) cannot become a batch."""


class LossError(RedcoastError, TypeError):
    """``loss_fn`` returned something that is not a scalar loss (with optional metrics)."""


#: the causes of a NaN loss that lie in the data, where JAX gives NaN and PyTorch does not
DATA_CAUSES = ("labels of -100 (PyTorch's ignore_index: JAX's cross-entropy gives NaN for them, "
               "even masked; set them to 0 and mask them out), token ids at or above the "
               "model's vocab_size (JAX's embedding lookup gives NaN where PyTorch raises), NaN "
               "or inf in the batch")


class NonFiniteLossError(RedcoastError, FloatingPointError):
    """The training loss became NaN or infinite; no update from that step was applied."""

    @classmethod
    def at(cls, step, value, findings=(), batch_checked=False):
        """The error for a loss that became ``value`` at ``step``; ``findings``: what
        :mod:`redcoast.loop.batch_diagnosis` found in the parameters and (``batch_checked``) the
        step's batch."""
        text = (f"The training loss became {value} at step {step} (counting from 0), so training "
                "stopped and no checkpoint was written after it; the last checkpoint on disk, if "
                "any, is from before it.")
        if step == 0:
            text += (" No update had been applied yet, so the learning rate is not the cause: "
                     "the loss of the starting parameters on that batch is.")
        if findings:
            text += " Found: " + "; ".join(findings) + "."
        elif batch_checked:
            text += (" Its batch holds no NaN, inf, negative or out-of-vocabulary value and the "
                     "parameters are finite: look at the loss (a log of 0, a division by a "
                     "mask's zero sum).")
        if step == 0:
            return cls(text + f" Fix: check the batch and the loss for {DATA_CAUSES}.")
        return cls(text + " Fix: lower the learning rate, add warmup or gradient clipping "
                   "(optax.clip_by_global_norm), or check that step's batch for bad values "
                   f"({DATA_CAUSES}).")

    @staticmethod
    def first_bad(history):
        """The first non-finite loss among logged metrics (``[{"loss": ...}, ...]``)."""
        bad = [float(m["loss"]) for m in history if not math.isfinite(float(m["loss"]))]
        return str(bad[0]) if bad else "NaN or inf"


class CheckpointError(RedcoastError, RuntimeError):
    """A workdir or its checkpoints cannot be used as asked (in use, none restorable, ...)."""


class LayoutCheckError(RedcoastError, AssertionError):
    """A layout's loss or gradients differ from one device's (``Trainer.check_layout``)."""


class EvaluationError(RedcoastError, RuntimeError):
    """An evaluation during ``fit`` failed; the message says in which function (the original
    error is its ``__cause__``) and which checkpoint a rerun resumes from."""


class PlanError(ValueError):
    """A plan asked for what cannot be planned here; the message says how to ask instead."""


class CompileFailure(PlanError):
    """The compiler failed on one layout's step for a reason other than memory."""
