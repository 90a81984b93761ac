"""Errors a user can cause, each carrying a message that names the cause and the fix."""


class RedcoastError(Exception):
    """Base class of every error redcoast raises on purpose."""


class ConfigError(RedcoastError, ValueError):
    """The run's configuration cannot work (devices, batch sizes, shards, rules)."""


class DataError(RedcoastError, ValueError):
    """The output of ``collate_fn`` (or of ``pred_fn``) cannot become a batch."""


class LossError(RedcoastError, TypeError):
    """``loss_fn`` returned something that is not a scalar loss (with optional metrics)."""


class NonFiniteLossError(RedcoastError, FloatingPointError):
    """The training loss became NaN or infinite; no update from that step was applied."""


class CheckpointError(RedcoastError, RuntimeError):
    """A workdir or its checkpoints cannot be used as asked (in use, none restorable, ...)."""


class LayoutCheckError(RedcoastError, AssertionError):
    """A layout's loss or gradients differ from one device's (``Trainer.check_layout``)."""


class EvaluationError(RedcoastError, RuntimeError):
    """An evaluation during ``fit`` failed; the message says in which function (the original
    error is its ``__cause__``) and which checkpoint a rerun resumes from."""
