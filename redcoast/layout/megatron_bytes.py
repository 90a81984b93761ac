"""A compiled step's bytes between model shards against Megatron's split of its own plan.

The data-flow analysis counts what Megatron-LM's split of the plan all-reduces in one forward
pass (row-parallel outputs, vocabulary-parallel lookups, contractions and reductions over a split
axis; ``ShardingPlan.megatron_wire_elements`` adds each one's conjugate in the backward pass). The
compiled step may move more: XLA spreading a split into values the plan keeps whole (an MoE's
routing), gathers of weights kept whole, a pattern the rewrites do not reach. Over
:data:`~redcoast.sharding.megatron_share.RATIO` times the ideal, :func:`bytes_shortfall` says by
how much, which weights are kept whole (if any) and which operations the largest extra
collectives came from, and what a user can do.
"""

from __future__ import annotations

import dataclasses
import re

from ..sharding.axes import MODEL_AXIS
from ..sharding.megatron_share import RATIO
from ..sharding.paths import path_to_str
from .comms import collective_report

_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NAMED = 3  # operations named


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Bytes one device sends between model shards per step: the compiled step's, and
    Megatron's for its plan at the compiled step's bytes per value (None when the plan cannot
    say; compared by values, so that a compiler reducing bfloat16 in float32 compares alike)."""
    compiled: float
    megatron: float | None
    largest: tuple = ()  # (operation, wire bytes), the costliest first

    @property
    def ratio(self):
        return self.compiled / self.megatron if self.megatron else None


def step_bytes(compiled, plan, mesh, accumulate_grad_batches=1) -> StepBytes:
    """The :class:`StepBytes` of ``compiled``, a training step of ``plan`` on ``mesh``."""
    report = collective_report(compiled, mesh)
    by_op: dict = {}
    wire = values = 0.0
    for c in report.collectives:
        if c.axis == MODEL_AXIS:
            m = _OP_NAME.search(c.line)
            name = f"{c.kind} of {_operation(m.group(1)) if m else c.computation}"
            by_op[name] = by_op.get(name, 0.0) + c.wire_bytes * c.times
            wire += c.wire_bytes * c.times
            values += c.wire_bytes * c.times * (c.elements / c.bytes if c.bytes else 0.0)
    largest = tuple(sorted(by_op.items(), key=lambda kv: -kv[1]))
    ideal = plan.megatron_wire_elements(accumulate_grad_batches)
    per_value = wire / values if values else 4.0  # float32 where nothing was sent
    return StepBytes(wire, None if ideal is None else ideal * per_value, largest)


def _operation(op_name):
    """``jit(step)/transpose(jvp())/dot_general`` -> 'dot_general (backward)'."""
    last = op_name.rsplit("/", 1)[-1].strip("()")
    return f"{last} (backward)" if "transpose(" in op_name else last


def bytes_shortfall(measured: StepBytes, plan, fused: bool = True) -> str | None:
    """What to say when the compiled step moves over RATIO times Megatron's bytes, else None;
    ``fused``: whether the step ran the fusion rewrites (sharding/fusion.py)."""
    if measured.ratio is None or measured.ratio <= RATIO:
        return None
    n = plan.axis_sizes.get(MODEL_AXIS, 1)
    whole = plan.megatron_share().whole
    ops = ", ".join(f"{name} ({_size(wire)})" for name, wire in measured.largest[:_NAMED])
    if whole and plan.short_of_megatron():  # said at the layout's choice: named there
        cause = ("the weights kept whole that the warning on its parameter share names move "
                 "their activations between the shards")
        fix = "the fixes that warning names, or "
    elif whole:
        names = ", ".join(path_to_str(pl.path) for pl in whole[:_NAMED])
        more = f" and {len(whole) - _NAMED} more" if len(whole) > _NAMED else ""
        first = whole[0]
        cause = (f"weights kept whole on every model shard ({names}{more}; the first: "
                 f"{first.reason.removeprefix('replicated: ')}) move their activations between "
                 f"the shards")
        fix = (f"name a split of them in params_sharding_rules (e.g. "
               f"({tuple(str(k) for k in first.path)!r}, PartitionSpec(...)) with 'mp' on the "
               f"axis to split; the layout check compares the result with one device), or ")
    else:
        cause = ("the plan splits every matmul weight Megatron would, but the compiled step "
                 "sums or gathers more between the shards than that split needs")
        fix = ""
    if not fused:
        fix += ("fuse_matmuls=True (off in this run, as with a train_step_fn of your own: "
                "matmuls reading one input, Q/K/V, then each sum its gradient over the shards), "
                "or ")
    return (f"the compiled step moves {measured.ratio:.2f}x the bytes between the {n} model "
            f"shards that Megatron's split of this plan would ({_size(measured.compiled)} per "
            f"device per step, not {_size(measured.megatron)}): {cause}. The "
            f"largest: {ops}. Fix: {fix}n_model_shards=1 or 'auto' to compare with training "
            f"data-parallel")


def said(compiled, layout, accumulate_grad_batches, log_warning) -> tuple:
    """``(StepBytes, what was said or None)`` for ``compiled``, the training step of ``layout``:
    measured, and over RATIO said through ``log_warning`` (a Trainer after a layout's first step,
    ``redcoast plan`` after its compile)."""
    measured = step_bytes(compiled, layout.plan, layout.mesh, accumulate_grad_batches)
    short = bytes_shortfall(measured, layout.plan, layout.fuse_matmuls)
    if short:
        log_warning(short + ".")
    return measured, short


def _size(n):
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
