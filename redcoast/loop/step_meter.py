"""What one compiled training step processes, costs and needs: for the logged throughput and
for the check, before the first step on an accelerator, that the step fits a device."""

from __future__ import annotations

import time

import jax
import numpy as np

from ..layout.flops import traced_flops
from ..layout.memory_check import StepMemory, compiler_refusal, require_fits
from ..layout.throughput import StepCost, peak_flops, tokens_per_example
from ..multihost.host import to_host
from ..sharding.context import tracing_for


class LogWindow:
    """The metrics of the updates since the last log line, and the wall time of those after
    the first update of a loop (whose call compiles), pulled in one host sync, so that the
    window holds their execution, not only their dispatch."""

    def __init__(self, every: int, end: int | None, first_position: int):
        self.every, self.end, self.first_position = every, end, first_position
        self.pending: list = []
        self.timed, self.since = 0, time.perf_counter()

    def add(self, metrics, position: int) -> bool:
        """The metrics of the update that reached ``position``; True: time to log."""
        self.pending.append(metrics)
        if position == self.first_position + 1:  # the first call compiles: time from its end
            self.since = time.perf_counter()
        else:
            self.timed += 1
        return len(self.pending) == self.every or position == self.end

    def pull(self, nonfinite_step) -> tuple[list, int, int, float]:
        """``(metrics, first non-finite step or -1, timed updates, their seconds)``; the next
        window starts at :meth:`restart` (after the logging, which it does not time)."""
        history, bad_step = to_host((self.pending, nonfinite_step))
        return history, int(bad_step), self.timed, time.perf_counter() - self.since

    def restart(self) -> None:
        self.pending, self.timed, self.since = [], 0, time.perf_counter()


class StepMeter:
    """The costs of one layout's training step, read once per batch shape (lowering and
    compiling again after the step ran is a cache hit)."""

    def __init__(self, layout, compute_dtype, accumulate_grad_batches: int, deployer):
        self.layout, self.compute_dtype = layout, compute_dtype
        self.accumulate_grad_batches, self.deployer = accumulate_grad_batches, deployer
        self._costs: dict = {}
        self._fitting: set = set()  # (state, batch) shapes whose step was found to fit

    def _compiled(self, state, batch, key):
        return self.layout.train_step.lower(state, batch, key).compile()

    def _model_flops(self, state, batch, key):
        """The step's matrix-product and convolution FLOPs over the mesh's devices, from its
        trace (flops.py; XLA's cost analysis misses cuBLAS's matmuls on GPUs). Traced with
        XLA's attention, not a vendor kernel, so that attention counts at full length as in
        PaLM's formula."""
        with tracing_for(self.layout.n_model_shards, vendor_kernels=False):
            flops = traced_flops(self.layout.train_step.__wrapped__, state, batch, key)
        return flops / self.layout.mesh.size if flops > 0 else None

    def cost(self, state, batch, key) -> StepCost:
        """What one update of batches shaped like ``batch`` processes and costs."""
        leaves = jax.tree_util.tree_leaves(batch)
        shape_key = _shapes(batch)
        if shape_key in self._costs:
            return self._costs[shape_key]
        k = self.accumulate_grad_batches
        examples = leaves[0].shape[1 if k > 1 else 0] * k
        micro = batch if k == 1 else jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch)
        per_example = tokens_per_example(micro)
        device = self.layout.mesh.devices.flat[0]
        cost = StepCost(examples=examples,
                        tokens=None if per_example is None else per_example * examples,
                        flops_per_device=self._model_flops(state, batch, key),
                        peak_flops=peak_flops(device, self.compute_dtype))
        why_not = cost.mfu_unknown_reason(device, self.compute_dtype)
        if why_not and not self._costs:  # said once
            self.deployer.log_info(f"MFU: n/a ({why_not}).")
        self._costs[shape_key] = cost
        return cost

    def require_fits(self, state, batch, key) -> None:
        """On an accelerator (or with ``memory_budget_bytes``): the compiled step's peak against
        the device's memory, so that a step too big stops before running with its memory
        explained (memory_check.py). The step's own call reuses this compilation. Checked
        once per state and batch shape: each ``train`` call asks, and the compiler's memory
        analysis alone took 0.12 s a call for a 22-layer model (a stall before the call's first
        step)."""
        deployer = self.deployer
        if deployer.platform == "cpu" and not deployer.memory_budget_bytes:
            return  # simulated devices share the host's memory: no per-device limit to hold
        # the state's leaves only: its structure holds the user's apply_fn, maybe unhashable
        shape_key = _leaf_shapes(state), _shapes(batch)
        if shape_key in self._fitting:
            return
        source = ("Deployer(memory_budget_bytes=...)" if deployer.memory_budget_bytes else
                  f"the {deployer.platform} device's memory limit")
        budget, name = deployer.device_memory_budget(), f"layout {self.layout.name}"
        try:
            compiled = self._compiled(state, batch, key)
        except jax.errors.JaxRuntimeError as e:  # a TPU compiler refuses a step too big
            refusal = compiler_refusal(e)
            if refusal is None:
                raise
            require_fits(StepMemory.refused(refusal, state), budget, name,
                         source + "; the compiler refused the step")
            raise
        require_fits(StepMemory.of(compiled, state), budget, name, source)
        self._fitting.add(shape_key)


def _leaf_shapes(tree):
    """The shapes and dtypes of ``tree``'s leaves (a Python number's type for its dtype)."""
    return tuple((np.shape(x), getattr(x, "dtype", type(x)))
                 for x in jax.tree_util.tree_leaves(tree))


def _shapes(tree):
    """``tree``'s structure and its leaves' shapes and dtypes: what a compiled step depends on
    within one layout."""
    return jax.tree_util.tree_structure(tree), _leaf_shapes(tree)
