"""A recurrent cell split by hidden units or kept whole, by what each costs.

A scan that applies the same weights at every step (an LSTM or GRU under ``lax.scan``) is a
recurrent cell. Split by hidden units (its gate kernels by output columns), each model shard
computes its share of the gates and the state; the state is all-gathered at every step for the
next step's product with the recurrent kernel (its gradient reduce-scattered backward), and the
cell's outputs once after the loop. Kept whole, every model shard repeats the cell's matmuls
(forward and backward: 3x their FLOPs) on its data shard's batch.

The split is chosen where the compute it stops repeating outweighs the collectives it adds, both
in FLOPs at the platform's rates (:class:`LinkCosts`, from layout/cost_model.py): each byte a
device sends, and each collective's latency, which a cell pays at every step.

Measured on 8 simulated CPU devices, 2 x 4, a 2-layer LSTM LM (tests/written_by_others.py's
``lstm_lm``, batch 8, 8 steps), the step with the cells split against whole (each split forced
by params_sharding_rules; both train equal to one device): 32 units 15.8 against 11.4 ms, 128
units 19.6 against 30.8, 256: 42.5 against 116, 512: 225 against 501, 768: 364 against 1087.
On CPU's rates the weighing keeps the cells whole at 512 units (302 MFLOP saved against 366)
and splits them at 768 (679 against 497): on the safe side of the measured crossover (between
32 and 128), as the rates do not see how slowly a step's small matmuls run. The compiled split
step moves 0.99x (jax 0.10) and 1.04x (jax 0.12) the bytes these collectives count.
"""

import dataclasses
import math

import jax.numpy as jnp

from ..interpreter import sub_programs, total
from .values import shape_of

# the state's collectives a step: its all-gather forward, and backward its all-gather again (a
# scan's backward pass keeps the carry as split as the forward took it: the gather is the
# partitioner's, not a value autodiff can keep) and its gradient's reduce-scatter; the outputs
# are gathered once after the loop and their gradient scattered once
STATE_COLLECTIVES, OUTPUT_COLLECTIVES = 3, 2


@dataclasses.dataclass(frozen=True)
class LinkCosts:
    """Communication in FLOPs of compute, the exchange rate of choices that trade one for the
    other: per byte a device sends (``flops_per_byte``), per collective (its latency,
    ``flops_per_collective``); ``data_shards``: the devices the traced batch is split over."""
    flops_per_byte: float
    flops_per_collective: float
    data_shards: int = 1


@dataclasses.dataclass(frozen=True)
class CellCost:
    """Per device and training step: the FLOPs a hidden-unit split stops repeating (``saved``),
    and what its collectives cost in FLOPs (``added``)."""
    saved: float
    added: float
    reduced_elements: float  # its collectives as all-reduced elements of one forward pass (the
    # plan's Megatron figure, which doubles them for the backward pass: a gather a quarter each)

    @property
    def pays(self):
        return self.saved > self.added

    def said(self):
        verb = "saves" if self.pays else "would save"
        return (f"the split {verb} {self.saved / 1e6:.3g} MFLOP of repeated compute per device "
                f"and step, its collectives cost {self.added / 1e6:.3g} MFLOP at this "
                f"platform's rates")


def matmul_flops(eqn):
    """Multiply-adds x 2 of a ``dot_general``: its output's size times its contracted size."""
    lhs, (contracted, _) = shape_of(eqn.invars[0]), eqn.params["dimension_numbers"][0]
    return 2.0 * math.prod(shape_of(eqn.outvars[0])) * math.prod(lhs[d] for d in contracted)


def _matmul_flops_within(eqn, total_of):
    if eqn.primitive.name == "dot_general":
        return matmul_flops(eqn)
    if eqn.primitive.name == "scan":
        return eqn.params["length"] * total_of(eqn.params["jaxpr"])
    return sum(total_of(p) for _, _, p in sub_programs(eqn))


def cell_cost(eqn, n_carry, n_model_shards, link_costs):
    """The :class:`CellCost` of splitting the recurrent cell run by the scan ``eqn`` (its
    ``n_carry`` loop carries the state) over ``n_model_shards``; None without ``link_costs``."""
    if link_costs is None:
        return None
    steps = eqn.params["length"]
    mp, dp = n_model_shards, link_costs.data_shards
    saved = 3 * steps * total(eqn.params["jaxpr"], _matmul_flops_within) * (1 - 1 / mp) / dp
    carries = [v for v in eqn.outvars[:n_carry] if _floating(v)]
    outputs = [v for v in eqn.outvars[n_carry:] if _floating(v)]
    elements = (STATE_COLLECTIVES * steps * sum(math.prod(shape_of(v)) for v in carries)
                + OUTPUT_COLLECTIVES * sum(math.prod(shape_of(v)) for v in outputs))
    sent = (STATE_COLLECTIVES * steps * sum(_bytes_of(v) for v in carries)
            + OUTPUT_COLLECTIVES * sum(_bytes_of(v) for v in outputs))
    added = (sent * (mp - 1) / mp / dp * link_costs.flops_per_byte
             + (STATE_COLLECTIVES * steps + OUTPUT_COLLECTIVES) * link_costs.flops_per_collective)
    return CellCost(saved, added, elements / 4)


def split_by_hidden_units(cost):
    """Whether a recurrent cell of ``cost`` (a CellCost, or None: not weighed) is split."""
    return cost is not None and cost.pays


def _floating(v):
    dtype = getattr(v.aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _bytes_of(v):
    return v.aval.dtype.itemsize * math.prod(shape_of(v))
