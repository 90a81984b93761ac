"""How far a plan's parameter split falls short of Megatron's, and what to tell the user.

Megatron-LM splits every matmul weight of a layer over the model shards (column, then row) and
the embedding by its vocabulary; vectors (norms, the row-parallel biases) stay whole. The plan's
own placements say which parameters the data flow saw as such weights (``Placement.weight``), so
the share of the parameters a device would hold under Megatron's split is computable from the
plan alone: every weight with an axis the shards divide split, the rest whole. A plan that keeps
weights whole (a pattern the analysis could not pass: a recurrent state, a norm over a split)
holds more; over :data:`RATIO` times Megatron's share, :func:`shortfall` names the weights kept
whole, the analysis's reason for each (the first operation their split could not pass), and the
fixes a user has.
"""

import dataclasses

import numpy as np

from .axes import MODEL_AXIS
from .paths import path_to_str

RATIO = 1.25
_NAMED = 3  # weights named per reason; the rest counted


@dataclasses.dataclass(frozen=True)
class Share:
    """Parameter bytes on one device under the plan (``held``) and under Megatron's split."""
    held: int
    megatron: float
    whole: tuple  # the weights kept whole that Megatron would split, largest first

    @property
    def ratio(self):
        return self.held / self.megatron if self.megatron else 1.0


def _placement_bytes(pl):
    return int(np.prod(pl.shape, dtype=np.int64)) * np.dtype(pl.dtype).itemsize


def megatron_share(placements, axis_sizes):
    """The :class:`Share` of ``placements`` (tensor-parallel, before FSDP) on ``axis_sizes``."""
    n = axis_sizes.get(MODEL_AXIS, 1)
    held, megatron, whole = 0, 0.0, []
    for pl in placements:
        size, on_device = _placement_bytes(pl), pl.bytes_per_device(axis_sizes)
        held += on_device
        splittable = pl.weight and any(d % n == 0 for d in pl.shape)
        megatron += size / n if splittable else size
        if splittable and on_device == size:
            whole.append(pl)
    whole.sort(key=lambda pl: -_placement_bytes(pl))
    return Share(held, megatron, tuple(whole))


def shortfall(placements, axis_sizes):
    """What to say when the plan holds over :data:`RATIO` times Megatron's share, else None."""
    n = axis_sizes.get(MODEL_AXIS, 1)
    share = megatron_share(placements, axis_sizes)
    if n == 1 or share.ratio <= RATIO or not share.whole:
        return None
    by_reason = {}
    for pl in share.whole:
        by_reason.setdefault(pl.reason.removeprefix("replicated: "), []).append(pl)
    kept = sum(_placement_bytes(pl) for pl in share.whole)
    lines = []
    for reason, pls in sorted(by_reason.items(), key=lambda kv: -sum(map(_placement_bytes, kv[1]))):
        names = ", ".join(path_to_str(pl.path) for pl in pls[:_NAMED])
        more = f" and {len(pls) - _NAMED} more" if len(pls) > _NAMED else ""
        lines.append(f"  {names}{more} ({sum(map(_placement_bytes, pls)) / 2**20:.2f} MiB): {reason}")
    first = share.whole[0]
    example = f"({tuple(str(k) for k in first.path)!r}, PartitionSpec(...))"
    return (f"the plan holds {share.ratio:.2f}x the parameters per device that Megatron's split "
            f"over {n} model shards would ({share.held / 2**20:.2f} MiB, not "
            f"{share.megatron / 2**20:.2f}): {kept / 2**20:.2f} MiB of matmul weights are kept "
            f"whole on every model shard (their matmuls are split by batch, or by positions, "
            f"over the model shards where the compute saved outweighs the activations moved, "
            f"else repeated on each):\n"
            + "\n".join(lines) +
            f"\nFix: if a split of them is right after all, name it in params_sharding_rules "
            f"(e.g. {example} with 'mp' on the axis to split; the layout check compares the "
            f"result with one device); where a size does not divide (heads reshaped above), a "
            f"number of model shards that divides it; else n_model_shards=1 or 'auto' trains "
            f"them data-parallel")
