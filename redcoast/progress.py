"""Where a run stands on the host: one frozen record, written into every checkpoint and read back.

The training state on the devices (parameters, optimizer state, step counter) is a
:class:`~redcoast.train_state.TrainState`; everything else a resume needs is a :class:`Progress`.
Positions inside an epoch are counted in examples of the epoch's order, so a run resumed with
another batch size, device count or accumulation goes on at exactly the next untrained example.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .store.checkpoint import key_from_json, key_to_json


@dataclasses.dataclass(frozen=True)
class Progress:
    """``step``: optimizer updates applied; ``epoch``: the epoch under way (from 0);
    ``position`` and ``examples``: the updates and the examples (in the epoch's order) of that
    epoch trained so far; ``best``: the best eval result kept so far per ``best_<min|max>_<name>``
    tag; ``train_key`` and ``eval_key``: the run's random keys (placed on the mesh)."""

    step: int = 0
    epoch: int = 0
    position: int = 0
    examples: int = 0
    best: Mapping[str, float] = dataclasses.field(default_factory=dict)
    train_key: Any = None
    eval_key: Any = None

    def replace(self, **changes: Any) -> Progress:
        return dataclasses.replace(self, **changes)

    def after_update(self, n_examples: int) -> Progress:
        """One more update of ``n_examples`` examples."""
        return self.replace(step=self.step + 1, position=self.position + 1,
                            examples=self.examples + n_examples)

    def next_epoch(self) -> Progress:
        """At the start of the next epoch (this one finished)."""
        return self.replace(epoch=self.epoch + 1, position=0, examples=0)

    def keys_from(self, other: Progress) -> Progress:
        """This progress with ``other``'s keys where it has none."""
        return self.replace(train_key=other.train_key if self.train_key is None else self.train_key,
                            eval_key=other.eval_key if self.eval_key is None else self.eval_key)

    def with_best(self, tag: str, value: float) -> Progress:
        return self.replace(best={**self.best, tag: value})

    def to_meta(self, to_host: Callable[[Any], Any]) -> dict:
        """The checkpoint's record of it (JSON; keys pulled to the host with ``to_host``)."""
        return {"step": self.step, "epoch": int(self.epoch), "position": int(self.position),
                "examples_consumed": int(self.examples),
                "train_rng": key_to_json(to_host(self.train_key)),
                "eval_rng": key_to_json(to_host(self.eval_key)), "best": dict(self.best)}

    @classmethod
    def from_meta(cls, meta: Mapping, examples: int, place: Callable[[Any], Any]) -> Progress:
        """From a checkpoint's record; ``examples``: of its epoch trained (see
        :func:`examples_trained`); ``place`` puts a key on the mesh."""
        return cls(step=int(meta["step"]), epoch=int(meta["epoch"]),
                   position=int(meta["position"]), examples=int(examples),
                   best=dict(meta.get("best", {})),
                   train_key=place(key_from_json(meta["train_rng"])),
                   eval_key=place(key_from_json(meta["eval_rng"])))


def checkpoint_meta(progress: Progress, epoch: int, position: int, config: Mapping | None,
                    examples: int | None, stream_fingerprint: str | None,
                    frozen_fingerprint: Any, to_host: Callable[[Any], Any]) -> dict:
    """A checkpoint's record: where a run resumed from it starts (``position`` updates and
    ``examples`` examples into ``epoch``; ``examples`` None: ``position`` updates of
    ``config``'s size where it has one, else left out), the run's ``config``, the fingerprint of
    a stream's consumed examples and of the frozen parameters the state was trained on."""
    if examples is None and (position == 0 or per_update_of(config) is not None):
        examples = position * (per_update_of(config) or 0)
    at = progress.replace(epoch=epoch, position=position, examples=examples or 0)
    meta = {**at.to_meta(to_host), "config": dict(config or {})}
    if examples is None:  # unknown: a resume takes position updates of its own size
        del meta["examples_consumed"]
    if stream_fingerprint is not None:  # what the consumed examples were
        meta["stream_fingerprint"] = stream_fingerprint
    meta["frozen_params"] = frozen_fingerprint  # which base adapters need
    return meta


def saved_part(state) -> dict:
    """What a checkpoint holds of a TrainState (of arrays, or of their shardings)."""
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "nonfinite_step": state.nonfinite_step}


def per_update_of(config: Mapping | None) -> int | None:
    """Examples per update recorded in a run's ``config``, or None."""
    config = config or {}
    if config.get("global_batch_size") is None or config.get("accumulate_grad_batches") is None:
        return None
    return int(config["global_batch_size"]) * int(config["accumulate_grad_batches"])


def examples_trained(meta: Mapping, per_update: int | None, warn: Callable[[str], None]) -> int:
    """Examples of the checkpoint's epoch (in its order) trained before it. A checkpoint of the
    earlier format records only updates: of the size its config records, else (said with
    ``warn``) of this run's ``per_update`` (None: not known, taken as 0)."""
    if "examples_consumed" in meta:
        return int(meta["examples_consumed"])
    position = int(meta["position"])
    recorded = per_update_of(meta.get("config"))
    if position == 0 or recorded is not None or per_update is None:
        return position * (recorded or 0)
    warn(f"the checkpoint at step {meta['step']} does not record how many examples of epoch "
         f"{meta['epoch'] + 1} it trained, only {position} updates, nor their size: taking "
         f"this run's updates of {per_update}, so {position * per_update} examples are skipped. "
         "If the interrupted run used another batch size, examples are skipped or repeated. "
         "Fix: resume with that run's per_device_batch_size, devices and "
         "accumulate_grad_batches.")
    return position * per_update
