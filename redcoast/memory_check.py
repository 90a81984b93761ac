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

from .errors import ConfigError


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

    def table(self, budget):
        rows = [("parameters", self.params), ("optimizer state", self.optimizer),
                ("temporaries", self.temporaries), ("peak per device", self.peak),
                ("device memory", budget)]
        return "\n".join(f"  {name:<17}{size(n):>12}" for name, n in rows)


# The TPU compiler refuses a step over the device's memory at compile time (no memory analysis
# comes back): "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: ... the total memory required for
# HLO temporaries (114.30G) exceeds available HBM (30.75G)" (libtpu 0.0.50, jax 0.12)
_REFUSAL = re.compile(r"CompileTimeHbmOom.*?HLO temporaries \(([\d.]+)([KMGT])\)", re.S)
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def refused_temporaries(error):
    """The temporaries (bytes) a compiler's out-of-memory refusal of a step says it needs, or
    None when ``error`` is no such refusal."""
    found = _REFUSAL.search(str(error))
    return None if found is None else int(float(found.group(1)) * _UNITS[found.group(2)])


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
