"""Evaluation of ``loss_fn`` over examples: exact means, every example counted once.

``loss_fn`` is applied to one example at a time (``eval_by='example'``: padded rows count for
nothing, so the result does not depend on the batch size) or to whole batches (``'batch'``: a
loss defined over the batch, such as a contrastive one), weighted by their rows.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..data import BatchMaker, check_collated, global_batch_size, padded_batches, prefetch, take
from ..errors import LossError
from ..multihost.heartbeat import heartbeat
from ..multihost.host import to_host
from .in_flight import InFlight


@dataclasses.dataclass(frozen=True)
class EvalRun:
    """What one evaluation reads: the layout and the state in it, the eval key, ``collate_fn``,
    the examples and the global batch size, and where to say what it decided."""

    layout: Any
    state: Any
    key: Any
    collate_fn: Callable
    examples: Sequence
    global_batch: int
    log_info: Callable[[str], None]

    def means(self, eval_by: str | None) -> tuple[dict, str | None]:
        """``({"loss": ..., name: ...}, eval_by)``: the means, and how ``loss_fn`` was applied
        (``eval_by`` None: decided on the first batch, see :meth:`_decide`)."""
        if eval_by == "batch":
            return self._by_batch(), eval_by
        maker = BatchMaker(self.layout.mesh, self.collate_fn, self.global_batch)
        batches = prefetch((maker.make(self.examples, idx), maker.padding_mask(n_real), idx, n_real)
                           for idx, n_real in padded_batches(len(self.examples), self.global_batch))
        totals, count, in_flight = None, 0.0, InFlight()
        for batch, mask, idx, n_real in batches:
            sums, n, spread = self.layout.eval_step(self.state, batch, mask, self.key)
            heartbeat()  # redcoast launch's watchdog: evaluation is progress too
            in_flight.add(n)
            if eval_by is None:  # the first evaluation: is the loss defined per example?
                eval_by = self._decide(idx, n_real, batch, sums, spread)
                if eval_by == "batch":
                    return self._by_batch(), eval_by
            totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
            count = count + n
        totals, count = to_host((totals, count))
        return {k: float(v) / float(count) for k, v in totals.items()}, eval_by

    def _decide(self, idx, n_real, batch, sums, spread) -> str:
        """"batch" where ``loss_fn`` is defined over the batch: every example alone gives the
        same loss (a contrastive loss gives 0) but the whole batch another; else "example"."""
        low, high, total = (float(x) for x in to_host((*spread, sums["loss"])))
        if n_real < 2 or high - low > 1e-6 * max(abs(low), abs(high), 1e-30):
            return "example"
        whole, n = self._batch_sums(idx, n_real, batch)
        batch_loss = float(to_host(whole["loss"])) / float(n)
        if abs(batch_loss - total / n_real) <= 1e-5 * max(abs(batch_loss), 1e-6):
            return "example"
        self.log_info(
            f"loss_fn gives every example of the first evaluation batch alone the same loss "
            f"({low:.6g}) but the batch {batch_loss:.6g}: it is defined over the batch, so "
            "evaluation applies it to whole batches (the last, smaller batch as it is). Pass "
            "Trainer(..., eval_by='batch') to say so, or eval_by='example' to keep the mean "
            "over single examples.")
        return "batch"

    def _by_batch(self) -> dict:
        """Means of ``loss_fn`` over whole batches, weighted by their rows; the last, smaller
        batch is collated whole on every process and placed replicated, never padded."""
        maker = BatchMaker(self.layout.mesh, self.collate_fn, self.global_batch)
        totals, count, in_flight = None, 0.0, InFlight()
        for idx, n_real in padded_batches(len(self.examples), self.global_batch):
            batch = maker.make(self.examples, idx) if n_real == self.global_batch else None
            sums, n = self._batch_sums(idx, n_real, batch)
            heartbeat()
            in_flight.add(n)
            totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
            count = count + n
        totals, count = to_host((totals, count))
        return {k: float(v) / float(count) for k, v in totals.items()}

    def _batch_sums(self, idx, n_real, batch):
        """``loss_fn`` on one whole batch (``batch``, placed; or, when the batch is the last and
        smaller one, its ``n_real`` examples of ``idx`` collated whole and placed replicated)."""
        if n_real == len(idx):
            return self.layout.batch_eval_step(self.state, batch, self.key)
        rest = check_collated(self.collate_fn(take(self.examples, idx[:n_real])), n_real)
        return self.layout.remainder_eval_step(
            self.state, jax.device_put(rest, self.layout.replicated), self.key)


def first_eval_batch(examples: Sequence, collate_fn: Callable, per_device_batch_size: int, mesh):
    """The first evaluation batch on ``mesh`` (padded as the evaluation pads it)."""
    n = global_batch_size(per_device_batch_size, mesh)
    indices = np.minimum(np.arange(n), len(examples) - 1)
    return BatchMaker(mesh, collate_fn, n).make(examples, indices)


def check_eval_loss(loss_fn: Callable | None, collate_fn: Callable, compute_dtype: Any, state: Any,
                    key: Any, eval_examples: Sequence) -> None:
    """Trace (not run) ``loss_fn`` with ``is_training=False`` on one eval example, as the
    evaluation calls it, so that what it returns there is checked before any training."""
    if loss_fn is None:
        return
    from ..layout.steps import cast_floating, split_loss_output, with_frozen_cast
    # a collate_fn drawing from the global random generators (masking, augmentation) must
    # draw for training exactly what it drew before this check existed
    states = random.getstate(), np.random.get_state()
    try:
        batch = check_collated(collate_fn(take(eval_examples, [0])), 1)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)

    def eval_loss(state, batch, rng):
        return split_loss_output(loss_fn(rng, with_frozen_cast(state, compute_dtype),
                                         cast_floating(state.params, compute_dtype), batch, False))
    try:
        jax.eval_shape(eval_loss, state, batch, key)  # the stored state: the user's shapes
    except LossError as e:
        raise LossError(
            f"{e} (Found before any training, by tracing loss_fn with is_training=False as "
            "the evaluation of eval_examples calls it; or pass eval_loss=False to evaluate "
            "with eval_predictor alone.)") from e
    except Exception:  # noqa: BLE001 - anything else the evaluation itself reports, in full
        pass
