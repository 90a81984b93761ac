"""Which parameters FSDP splits over the data shards: those whose memory is worth their cost.

Each tensor FSDP splits over 'dp' saves ``(g-1)/g`` of its bytes (and of its optimizer state) on
every device, and costs the step one more collective: the gather of the weight where the step uses
it (XLA sums its gradient with the others' either way). Splitting every tensor is what MaxText and
EasyDeL do; on 8 simulated CPU devices it cost task B1 (a 3.4 M-parameter Llama, issue 28) 4-6 %
of its step at 8x1, 1-2 % at 4x2 and nothing measurable at 2x4. So the choice is made by cost,
not by a size threshold: the tensors that save the most memory per collective (the largest) are
split first, as long as the gathers added stay within ``TIE`` of the step's estimated time; where
the training state would take more than ``PRESSURE`` of a device's memory, every tensor is split
(the room is worth more than the time).

The estimate needs no compilation, so choosing costs no start-up: the step's time from its model
FLOPs (3x the loss's forward matrix products, flops.py) at the platform's rate, each gather's from
a latency per device in its group and its bytes (``RATES``).
"""

import dataclasses
import math
import os

import jax
import numpy as np

from ..multihost.host import process_0s
from ..sharding.axes import DATA_AXIS, MODEL_AXIS
from ..sharding.fsdp import gather_group
from .cost_model import mib

TIE = 0.02       # step time FSDP may add: within the noise of a step (issue 28's "2 %")
PRESSURE = 0.5   # a state over this share of a device's memory: split everything

# Per device. CPU: simulated devices share the host's cores; fitted on a 2-core host with 8
# devices (B1: 4.4 GFLOP per device and step in 0.43 s; one more all-gather per tensor cost about
# 0.45 ms over 8 devices, 0.15 ms over 4: latency x (g - 1)); the FLOP rate is per core, shared by
# the local devices. Accelerators: nominal (XLA combines and overlaps their gathers).
RATES = {
    "cpu": dict(flop_rate_per_core=4e10, latency=6e-5, gather_rate=1e10),
    "gpu": dict(flop_rate=2e14, latency=2e-6, gather_rate=1e11),
    "tpu": dict(flop_rate=2e14, latency=2e-6, gather_rate=1e11),
}


@dataclasses.dataclass(frozen=True)
class FsdpChoice:
    """The tensors FSDP leaves replicated over 'dp' (``keep``), and why, in ``note``."""
    keep: frozenset
    note: str


def state_fills_a_device(params, n_model_shards, budget_bytes, state_bytes_per_param_byte=3.0):
    """Whether the training state of ``params`` split over the model shards alone would take
    over ``PRESSURE`` of a device's ``budget_bytes``: then FSDP splits every tensor from the
    start (before the first batch, when the by-cost choice is made, the parameters must fit)."""
    total = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                for x in jax.tree_util.tree_leaves(params) if hasattr(x, "dtype"))
    return state_bytes_per_param_byte * total / max(1, n_model_shards) > PRESSURE * budget_bytes


def flop_rate(platform, n_local_devices):
    """Model FLOP/s one device of ``platform`` runs a training step at (by ``RATES``)."""
    r = RATES.get(platform, RATES["gpu"])
    if "flop_rate" in r:
        return r["flop_rate"]
    cores = os.cpu_count() or 1
    return r["flop_rate_per_core"] * min(1.0, cores / max(1, n_local_devices))


def choose_fsdp(placements, axis_sizes, platform, step_flops, n_local_devices,
                state_bytes_per_param_byte=3.0, budget_bytes=None):
    """The :class:`FsdpChoice` for ``placements`` (the stored placements without FSDP) on a mesh
    of ``axis_sizes``, for a step of ``step_flops`` model FLOPs per device.
    ``state_bytes_per_param_byte``: what a parameter byte costs a device in all (itself, its
    gradient, its optimizer state)."""
    n_data, n_model = axis_sizes.get(DATA_AXIS, 1), axis_sizes.get(MODEL_AXIS, 1)
    r = RATES.get(platform, RATES["gpu"])
    splittable = []
    for pl in placements:
        g = gather_group(pl, n_data, n_model)
        if g is not None:
            b = pl.bytes_per_device(axis_sizes)
            splittable.append((pl.path, b, r["latency"] * (g - 1) + b * (g - 1) / g / r["gather_rate"]))
    if not splittable:
        return FsdpChoice(frozenset(), "")
    splittable.sort(key=lambda t: -t[1])  # most memory per gather first
    total = sum(b for _, b, _ in splittable)
    step = step_flops / flop_rate(platform, n_local_devices)
    state = state_bytes_per_param_byte * sum(pl.bytes_per_device(axis_sizes) for pl in placements)
    if budget_bytes and state > PRESSURE * budget_bytes:
        return FsdpChoice(frozenset(), (
            f"FSDP splits all {len(splittable)} tensors it can: the training state would take "
            f"{mib(state)} per device without it, over {PRESSURE:.0%} of the device's {mib(budget_bytes)}"))
    spent, split = 0.0, 0
    for _, _, cost in splittable:
        if spent + cost > TIE * step:
            break
        spent, split = spent + cost, split + 1
    keep = frozenset(path for path, _, _ in splittable[split:])
    saved = sum(b for _, b, _ in splittable[:split])
    all_cost = sum(c for _, _, c in splittable)
    head = (f"FSDP by cost: {split} of {len(splittable)} tensors split over dp ({mib(saved)} of "
            f"{mib(total)} of parameters per device, with their optimizer state); estimated "
            f"{spent * 1e3:.2f} ms of gathers on a {step * 1e3:.1f} ms step")
    if not keep:
        return FsdpChoice(keep, head)
    return FsdpChoice(keep, head + (
        f"; splitting all would add {all_cost * 1e3:.2f} ms ({all_cost / step:.1%}, over the "
        f"{TIE:.0%} allowed). fsdp=True splits them all, fsdp=False none"))


def agreed_by_all_processes(choice, paths):
    """Process 0's ``choice`` on every process (``paths``: every parameter's, in the same order
    on each). The estimate reads the host (its cores, its memory), and processes on hosts of
    different sizes must still build one plan; all processes call this at the first batch."""
    mask = process_0s(np.array([path in choice.keep for path in paths], np.int32))
    keep = frozenset(path for path, kept in zip(paths, mask) if kept)
    if keep == choice.keep:
        return choice
    return FsdpChoice(keep, f"{choice.note} (process 0's choice, taken by every process)")



def per_device_flops(forward_flops, n_devices):
    """A training step's model FLOPs per device: forward and backward (3x the forward's matrix
    products), spread evenly over the devices."""
    return 3.0 * float(forward_flops) / max(1, n_devices)

