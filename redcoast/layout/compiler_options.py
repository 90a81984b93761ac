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
"""

CPU_REMAT_KEPT = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def for_platform(platform):
    """The ``compiler_options`` of ``jax.jit`` for a step compiled for ``platform``'s devices
    ('cpu', 'gpu', 'tpu', ...): on XLA:CPU, remat's barriers kept (:data:`CPU_REMAT_KEPT`)."""
    return dict(CPU_REMAT_KEPT) if platform == "cpu" else {}


def for_mesh(mesh):
    """:func:`for_platform` of the devices of ``mesh`` (a ``jax.sharding.Mesh``)."""
    return for_platform(mesh.devices.flat[0].platform)
