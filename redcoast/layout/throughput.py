"""How fast a run goes: tokens in a batch, a compiled step's FLOPs, a device's peak, MFU.

Everything here reads shapes, compiled programs and device names only: nothing waits for the
device, so logging throughput adds no host synchronisation to the training loop.

MFU here is the training step's matrix-product and convolution FLOPs, counted in its trace
(redcoast/layout/flops.py: PaLM's 6N + 12·L·s·h per token, exactly, for a transformer) and spread over
the mesh's devices, over the time of one step and one device's peak. Work that devices repeat
(a replicated computation) counts once. With rematerialisation the recomputed forward counts
too (what PaLM calls hardware FLOPs utilisation); without it, it is the model FLOPs
utilisation. XLA's cost analysis of the compiled program (:func:`compiled_flops`) is not used:
on GPUs it misses the matrix products handed to cuBLAS.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

# Peak dense (no sparsity) FLOP/s of one JAX device, in TFLOP/s, from the vendors' data sheets:
# (pattern of the device kind, 16-bit floating point, float32 matmuls as XLA runs them by
# default: TF32 tensor cores on NVIDIA GPUs since Ampere). None: not published / not meaningful.
# The first matching pattern wins, so more specific names come first.
PEAK_TFLOPS = (
    (r"\bGH200\b", 989.4, 494.7),
    (r"\bH100\b.*\bPCIe\b", 756.0, 378.0),
    (r"\bH100\b.*\bNVL\b", 835.0, 417.5),
    (r"\bH100\b", 989.4, 494.7),            # SXM
    (r"\bH200\b", 989.4, 494.7),
    (r"\bB200\b", 2250.0, 1100.0),
    (r"\bA100\b", 312.0, 156.0),
    (r"\bL40S\b", 362.0, 183.0),
    (r"\bL4\b", 121.0, 60.0),
    (r"^TPU v6 lite", 918.0, None),         # v6e (Trillium)
    (r"^TPU v5 lite", 197.0, None),         # v5e
    (r"^TPU v5", 459.0, None),              # v5p
    (r"^TPU v4", 275.0, None),
    (r"^TPU v3", 61.5, None),               # per core: a v3 chip holds two JAX devices
    (r"^TPU v2", 22.5, None),
)


def peak_flops(device, compute_dtype):
    """Peak FLOP/s of ``device`` for matmuls in ``compute_dtype``, or None when unknown."""
    kind = getattr(device, "device_kind", "") or ""
    sixteen_bit = jnp.dtype(compute_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    for pattern, half, single in PEAK_TFLOPS:
        if re.search(pattern, kind):
            peak = half if sixteen_bit else single
            return None if peak is None else peak * 1e12
    return None


def compiled_flops(compiled):
    """FLOPs of one run of a compiled program on one device (XLA's cost analysis), or None."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis: no MFU, said by the caller
        return None
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per device program
        analysis = analysis[0] if analysis else None
    flops = (analysis or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def tokens_per_example(batch):
    """Tokens in one example of ``batch`` (a pytree of arrays, batch axis first): the length of
    its longest integer ``[batch, sequence]`` array (token ids), or None when it has none."""
    lengths = [x.shape[1] for x in jax.tree_util.tree_leaves(batch)
               if np.ndim(x) == 2 and jnp.issubdtype(x.dtype, jnp.integer)]
    return max(lengths) if lengths else None


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What one optimizer update processes and costs, fixed for one compiled step."""

    examples: int                     # per update, all micro-batches
    tokens: int | None                # per update, or None when the batch has no sequence axis
    flops_per_device: float | None    # the step's model FLOPs over the devices, one update
    peak_flops: float | None          # of one device, for the compute dtype

    def rates(self, steps, seconds):
        """``{name: value}`` for ``steps`` updates that took ``seconds`` of wall time."""
        out = {"step_time_s": seconds / steps, "examples_per_s": steps * self.examples / seconds}
        if self.tokens is not None:
            out["tokens_per_s"] = steps * self.tokens / seconds
        if self.flops_per_device is not None and self.peak_flops is not None:
            out["mfu"] = steps * self.flops_per_device / seconds / self.peak_flops
        else:
            out["mfu"] = None  # JSON null: unknown, not a number (see mfu_unknown_reason)
        return out

    def mfu_unknown_reason(self, device, compute_dtype):
        """Why MFU cannot be given here (None when it can)."""
        if self.peak_flops is None:
            return (f"no peak FLOP/s is known for device kind "
                    f"{getattr(device, 'device_kind', device.platform)!r} in "
                    f"{jnp.dtype(compute_dtype).name} (redcoast.layout.throughput.PEAK_TFLOPS)")
        if self.flops_per_device is None:
            return "the step has no matrix product or convolution to count (redcoast/layout/flops.py)"
        return None
