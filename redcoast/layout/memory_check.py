"""Does the compiled training step fit a device? Asked before the first step, so that a run
too big for its devices stops in seconds with the memory explained, not minutes later with the
accelerator's out-of-memory error.

The compiler's own memory analysis of the step gives the peak per device (arguments + outputs -
donated + temporaries); the state the layout holds is split out of it (parameters, optimizer
state; gradients live among the temporaries), so the message says what to shrink.
"""

import dataclasses
import re

import jax
import numpy as np

from ..errors import ConfigError


def per_device_bytes(tree):
    """Bytes one device holds of ``tree`` (arrays or placed ``jax.ShapeDtypeStruct``s)."""
    return int(sum(np.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(tree)))


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One device's share of a compiled training step, in bytes."""
    params: int
    optimizer: int
    temporaries: int   # the compiler's: activations, gradients in flight, buffers
    peak: int          # arguments + outputs - donated + temporaries

    @classmethod
    def of(cls, compiled, state):
        m = compiled.memory_analysis()
        return cls(params=per_device_bytes(state.params),
                   optimizer=per_device_bytes(state.opt_state),
                   temporaries=int(m.temp_size_in_bytes),
                   peak=int(m.argument_size_in_bytes + m.output_size_in_bytes
                            - m.alias_size_in_bytes + m.temp_size_in_bytes))

    @classmethod
    def refused(cls, refusal, state):
        """What a compiler that refused the step (a :class:`Refusal`) says one device needed."""
        params, optimizer = per_device_bytes(state.params), per_device_bytes(state.opt_state)
        return cls(params=params, optimizer=optimizer,
                   temporaries=max(0, refusal.needed_bytes - params - optimizer),
                   peak=refusal.needed_bytes)

    def table(self, budget):
        rows = [("parameters", self.params), ("optimizer state", self.optimizer),
                ("temporaries", self.temporaries), ("peak per device", self.peak),
                ("device memory", budget)]
        return "\n".join(f"  {name:<17}{size(n):>12}" for name, n in rows)



@dataclasses.dataclass(frozen=True)
class Refusal:
    """A compiler's refusal of a program too big for the device's memory."""
    needed_bytes: int   # one device's need as the compiler put it: arguments included
    available_bytes: int
    message: str        # the compiler's own words


# How each compiler words its refusal at compile time (no memory analysis comes back), as
# recorded in tests/test_memory_check.py. libtpu's figure for "HLO temporaries" includes the
# program's arguments (a 64 GiB argument summed alone is refused as "temporaries (64.00G)"), so
# it is the device's whole need. XLA:GPU (jax 0.10.2, 0.11.2) and XLA:CPU do not refuse: a step
# over an H100's memory compiles, XLA:GPU warning "Can't reduce memory use below ... by
# rematerialization", and its memory analysis gives the verdict.
_REFUSALS = (
    # libtpu 0.0.42.1 (jax[tpu]==0.10.2): "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total
    # memory required for HLO temporaries (38.64G) exceeds available HBM (30.75G)."; libtpu
    # 0.0.50.1 (jax 0.12) the same after "E1000: CompileTimeHbmOom: "
    re.compile(r"Ran out of memory on HBM, the total memory required for HLO temporaries "
               r"\((?P<needed>[\d.]+)(?P<unit>[KMGT])\) exceeds available HBM "
               r"\((?P<available>[\d.]+)(?P<available_unit>[KMGT])\)"),
    # older libtpu: "Ran out of memory in memory space hbm. Used 49.51G of 15.48G hbm. Exceeded
    # hbm capacity by 34.03G."
    re.compile(r"Ran out of memory in memory space hbm\. Used (?P<needed>[\d.]+)(?P<unit>[KMGT]) "
               r"of (?P<available>[\d.]+)(?P<available_unit>[KMGT]) hbm"),
)
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def compiler_refusal(error):
    """The :class:`Refusal` in ``error`` (a compiler's exception), or None when ``error`` is no
    refusal for memory."""
    text = str(error)
    for wording in _REFUSALS:
        found = wording.search(text)
        if found:
            return Refusal(
                needed_bytes=int(float(found["needed"]) * _UNITS[found["unit"]]),
                available_bytes=int(float(found["available"]) * _UNITS[found["available_unit"]]),
                message=text.strip().splitlines()[0])
    return None


def size(n):
    """Bytes as people read them."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def require_fits(memory, budget, layout_name, budget_source):
    """Raise, with the memory explained and what would fit, if ``memory`` exceeds ``budget``."""
    if memory.peak <= budget:
        return
    state = memory.params + memory.optimizer
    if state > 0.8 * budget:
        fix = ("the state alone nearly fills the device: more devices (the model split over "
               "more of them: a larger n_model_shards, or 'auto'), parameters in bfloat16, or an "
               "optimizer with less state (adafactor, sgd)")
    else:
        fix = ("a smaller per_device_batch_size (with accumulate_grad_batches to keep the "
               "global batch), a shorter sequence, compute_dtype=jnp.bfloat16, each layer "
               "rematerialised (redcoast's models: config_overrides={'remat': True}), or a "
               "larger n_model_shards")
    raise ConfigError(
        f"The training step does not fit the device: it needs {size(memory.peak)} per device "
        f"({layout_name}), the device has {size(budget)} ({budget_source}).\n"
        f"{memory.table(budget)}\nNothing was trained. Fix: {fix}. `redcoast plan` tries such "
        "setups without the hardware; Deployer(memory_budget_bytes=...) sets the budget if you "
        "know the device holds more.")
