"""The XLA options redcoast compiles a training step with, per platform.

XLA:CPU removes the optimization barriers that ``jax.checkpoint`` (remat) puts around the
recomputed forward pass (its pass ``cse_barrier_expander`` runs early in the CPU pipeline), and
its common-subexpression elimination then merges the recomputation back into the forward pass:
every layer's activations are kept for the backward pass, as without remat. Measured (jax
0.10.2): four rematerialised attention layers at 4096 tokens, 24.9 GiB of temporaries, as
without remat (24.8); with the pass off, 6.4 GiB (one layer's scores), and Llama-3-8B FSDP over
8 simulated devices at 4096 tokens with remat 54.8 GiB of temporaries instead of 209. With the
pass off the step computes the same numbers (bit for bit, measured) and recomputes what remat
asks for. jax 0.12's XLA:CPU keeps the barriers by itself (the same step holds one layer's
scores with or without the option; tests/test_compiler_options.py runs on both lines). XLA:GPU
and the TPU compiler honour remat as they are (Llama-3-8B on 8 H100s, the same
step: 128.5 GiB without remat, 61.0 GiB with it), so they are given nothing.

A step that computes in 16 bits on XLA:CPU also goes without the algebraic simplifier
(``algsimp``) and the pipeline that runs it to a fixed point (``simplification``). The XLA:CPU
of jax 0.11 and 0.12 keeps bfloat16 products in bfloat16 and hands them to YNNPACK only when the
left operand contracts its trailing dimensions (XLA's ``IsDotSupportedByYnn``); with the
simplifier on, weight gradients reach it as dots whose left operand contracts its leading one,
and those run in Eigen's bfloat16 GEMM, several times slower (with it off they keep the form
autodiff wrote, and YNNPACK takes every one). Measured (B2's 1B width, 2 layers, seq 128, 8
simulated devices at 8x1, jax 0.12.0.1): 29% of the step's dot FLOPs went to Eigen and the
hand-written step took 11.7 s; without the pass none do and it takes 5.0 s (MaxText's own step:
8.3 s; benchmarks/xla_cpu_dots.py reads the share). Without ``algsimp`` alone a deep model
compiled 5x as long (SmolLM2-135M's 30 layers, FSDP over 8 devices: 60.7 s against 11.6 with
both on; perf: in the fixed-point pipeline's other passes); with the whole pipeline off as
well, 30.1 s, the same 0% in Eigen, and redcoast's step computes the same eval loss to the bit
(its first update at 8x1 35 s against 64, steps 4.7-4.9 s either way; at 2x4 28 s against 35,
steps 4.9-5.2 against 4.8-5.0). Turning off that pipeline alone leaves the Eigen dots (7%);
turning off ``post_scatter_expansion_simplification`` too, a later pipeline that also runs
``algsimp``, aborts XLA:CPU (a gather it requires simplified: a CHECK failure).
A float32 step loses nothing to Eigen (its float32 GEMM is as fast as YNNPACK's here) and keeps
both. jax 0.10's XLA:CPU multiplies bfloat16 in float32, and there the pass helps (the same
step: 6.8 s with it, 7.2 s and 13% more memory without), so they are dropped only where XLA:CPU
keeps a bfloat16 product in bfloat16, which one compiled dot tells once per process.
"""

import functools
import re

import jax
import jax.numpy as jnp

CPU_REMAT_KEPT = {"xla_disable_hlo_passes": "cse_barrier_expander"}
# the simplifier and the fixed-point pipeline that runs it (XLA:CPU's names; the test checks
# that this jax's pipeline is still called so)
CPU_16_BIT_DOTS_IN_YNNPACK = ("algsimp", "simplification")
_HLO_NAMES = {"bfloat16": "bf16", "float16": "f16"}


def for_platform(platform, compute_dtype=None):
    """The ``compiler_options`` of ``jax.jit`` for a step compiled for ``platform``'s devices
    ('cpu', 'gpu', 'tpu', ...) computing in ``compute_dtype`` (None: float32): on XLA:CPU,
    remat's barriers kept (:data:`CPU_REMAT_KEPT`) and, computing in 16 bits, no algebraic
    simplifier nor its fixed-point pipeline (:data:`CPU_16_BIT_DOTS_IN_YNNPACK`)."""
    if platform != "cpu":
        return {}
    passes = [CPU_REMAT_KEPT["xla_disable_hlo_passes"]]
    if compute_dtype is not None and jnp.issubdtype(compute_dtype, jnp.floating) \
            and jnp.dtype(compute_dtype).itemsize < 4 and cpu_keeps_16_bit_dots(compute_dtype):
        passes.extend(CPU_16_BIT_DOTS_IN_YNNPACK)
    return {"xla_disable_hlo_passes": ",".join(passes)}


@functools.cache
def cpu_keeps_16_bit_dots(dtype) -> bool:
    """Whether XLA:CPU multiplies two ``dtype`` matrices in ``dtype`` (bfloat16 on jax 0.11 and
    0.12) rather than converting them to float32 first (jax 0.10): read from one small dot it
    compiles."""
    dtype = jnp.dtype(dtype)
    on_cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    matrix = jax.ShapeDtypeStruct((64, 64), dtype, sharding=on_cpu)
    text = jax.jit(jnp.matmul).lower(matrix, matrix).compile().as_text()
    products = re.findall(r"= (\w+)\[[0-9,]*\]\S* dot\(", text)
    if not products:  # fails loudly: the text is XLA's, and a change there must be seen
        raise RuntimeError(f"no dot in XLA:CPU's compiled matmul (jax {jax.__version__}): "
                           "redcoast/layout/compiler_options.py reads its text")
    return all(p == _HLO_NAMES.get(dtype.name) for p in products)


def for_mesh(mesh, compute_dtype=None):
    """:func:`for_platform` of the devices of ``mesh`` (a ``jax.sharding.Mesh``)."""
    return for_platform(mesh.devices.flat[0].platform, compute_dtype)
