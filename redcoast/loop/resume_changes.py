"""What a resumed ``Trainer.fit`` says about settings that differ from its checkpoint's run.

A checkpoint records fit's settings (``FitRun.config``: seed, batch sizes, accumulation,
``n_epochs``, ``max_steps``, the run's planned length in updates, compute dtype) and, where the
Trainer has an ``lr_schedule_fn``, the learning rate at a few updates: the first, the
checkpoint's own and the planned last. A schedule is a function, so it is compared by those
values: a resume with another ``n_epochs`` re-sizes a schedule built on the run's length, and
the rate at the resume step jumps (7e-6 -> 8.4e-4 in the issue that asked for this). Each
change is said in one warning, ``old -> new``; the Python API continues under the new settings
(``redcoast train`` refuses them unless allowed: redcoast/cli/run_record.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping


def planned_updates(train_size, n_epochs, max_steps, per_update) -> int | None:
    """The updates a run trains in all (the fewer of its epochs' and ``max_steps``), or None
    where not known (a stream without ``max_steps``)."""
    by_epochs = (None if train_size is None or n_epochs is None
                 else n_epochs * (train_size // per_update))
    known = [n for n in (by_epochs, max_steps) if n is not None]
    return min(known) if known else None


def lr_at(lr_schedule_fn: Callable | None, steps) -> list | None:
    """``[[step, learning rate], ...]`` at each of ``steps`` (JSON for a checkpoint's record),
    or None without a schedule (or one that cannot be read at those steps)."""
    if lr_schedule_fn is None:
        return None
    try:
        return [[int(s), float(lr_schedule_fn(int(s)))] for s in sorted(set(steps))]
    except Exception:  # noqa: BLE001 - a user's function of another signature: not compared
        return None


def changes(saved: Mapping, current: Mapping, lr_schedule_fn: Callable | None,
            step: int) -> list[str]:
    """``"what: old -> new"`` for each setting of the run's length and learning rate that
    differs between a checkpoint's record (``saved``, at update ``step``) and this run."""
    out = [f"{key} {_as_text(saved[key])} -> {_as_text(current.get(key))}"
           for key in ("n_epochs", "max_steps", "planned_updates", "compute_dtype")
           if key in saved and saved[key] != current.get(key)]
    now = dict(lr_at(lr_schedule_fn, [s for s, _ in saved.get("lr_at") or []]) or [])
    planned = saved.get("planned_updates")
    for s, lr in saved.get("lr_at") or []:
        if s in now and not math.isclose(lr, now[s], rel_tol=1e-6, abs_tol=1e-12):
            where = (" (this resume's)" if s == step else " (the first)" if s == 0 else
                     " (the last the checkpoint's run planned)" if s == planned else "")
            out.append(f"learning rate at update {s}{where} {lr:.4g} -> {now[s]:.4g}")
    return out


def warn_if_changed(deployer, saved: Mapping, current: Mapping,
                    lr_schedule_fn: Callable | None, step: int) -> None:
    """Say, in the log, every setting a resume at ``step`` changes (see the module's docstring)."""
    def changed(keys):
        return ", ".join(f"{k} ({saved[k]} -> {current[k]})" for k in keys
                         if k in saved and saved[k] != current[k])
    order = changed(("jax_seed", "train_size", "shuffle"))
    if order:
        deployer.log_warning(f"resuming with a different {order}: the data order changes, so "
                             "the run will not repeat the interrupted one.")
    grouping = changed(("global_batch_size", "accumulate_grad_batches"))
    if grouping:  # the order of the examples does not depend on the batch size
        deployer.log_warning(
            f"resuming with a different {grouping}: the epoch goes on at the first example the "
            "interrupted run had not trained, in the same order, but in updates of another "
            "size, so the run will not repeat the interrupted one exactly.")
    length = changes(saved, current, lr_schedule_fn, step)
    if length:
        unseen = ("" if lr_schedule_fn is not None and saved.get("lr_at") else
                  " A learning-rate schedule sized by the run's length changes with it; pass "
                  "Trainer(lr_schedule_fn=...) for its values to be compared.")
        deployer.log_warning(
            f"resuming at update {step} with other settings than the run that saved the "
            f"checkpoint: {'; '.join(length)}. The run goes on under the new ones, so it will "
            f"not repeat the interrupted one.{unseen} Fix: resume with that run's settings to "
            "continue it as it was, or pass resume=False (or use another workdir) to start "
            "afresh.")


def _as_text(value) -> str:
    return "None" if value is None else str(value)
