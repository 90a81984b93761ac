"""Learning-rate schedules counted in optimizer updates (not micro-batches)."""

import optax

from .errors import ConfigError

SCHEDULE_TYPES = ("linear", "cosine", "constant")


def n_updates_per_epoch(train_size, global_micro_batch_size, accumulate_grad_batches=1):
    """Optimizer updates in one epoch; the last incomplete batch is dropped in training."""
    return train_size // (global_micro_batch_size * accumulate_grad_batches)


def make_lr_schedule(total_updates, learning_rate, schedule_type="linear", warmup_steps=0,
                     init_learning_rate=0.0, end_learning_rate=0.0):
    """An optax schedule: linear warmup for ``warmup_steps`` updates, then ``schedule_type``."""
    if schedule_type not in SCHEDULE_TYPES:
        raise ConfigError(f"schedule_type={schedule_type!r} is not known. Fix: use one of "
                          f"{', '.join(map(repr, SCHEDULE_TYPES))}.")
    if total_updates <= 0:
        raise ConfigError(
            "The schedule has no optimizer update: the training set is smaller than one global "
            "batch. Fix: use a smaller per_device_batch_size or accumulate_grad_batches.")
    warmup_steps = min(int(warmup_steps), total_updates)
    decay_steps = max(total_updates - warmup_steps, 1)
    if schedule_type == "linear":
        after = optax.linear_schedule(learning_rate, end_learning_rate, decay_steps)
    elif schedule_type == "cosine":
        after = optax.cosine_decay_schedule(
            learning_rate, decay_steps, alpha=end_learning_rate / learning_rate if learning_rate else 0.0)
    else:
        after = optax.constant_schedule(learning_rate)
    if warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(init_learning_rate, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, after], boundaries=[warmup_steps])
