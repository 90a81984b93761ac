"""Model FLOPs of a traced program: the multiply-adds of its matrix products and convolutions,
counted in its jaxpr, so the same on every backend.

XLA's own cost analysis of a compiled program cannot serve for MFU on GPUs: it counts nothing for
the matrix products handed to cuBLAS as custom calls (on an H100, jax 0.11.2, it counted 1.7 of
the 7.3 GFLOP per token of a 1.1B Llama's training step). A count in the jaxpr is what PaLM's
formula (6N + 12·L·s·h per token) counts, exactly: every matrix product of the forward and the
backward pass, attention's included at full length; elementwise work is not counted.

Counted through nested programs: ``jit``, ``remat`` (recomputation counts: hardware FLOPs),
custom derivatives (the primal program), ``scan`` (times its length), ``cond`` (the costliest
branch), ``shard_map`` (its per-device body times the devices it runs on). A ``while`` loop's
trip count is not known from the program: its body counts once.
"""

import math

import jax
import numpy as np

from ..sharding.interpreter import sub_programs, total

DOT = "dot_general"
CONV = "conv_general_dilated"


def dot_general_flops(eqn):
    """2 x the multiply-adds of one ``dot_general``: every output element sums over the
    contracted dimensions."""
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)


def conv_flops(eqn):
    """2 x the multiply-adds of one convolution, as XLA counts them: each output element sums
    over its group's input features and the kernel taps that land on the input, not on padding
    or between dilated inputs (so a gradient's transposed convolution counts what it computes);
    the same for the batch-grouped form that differentiation emits."""
    p = eqn.params
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    lhs, rhs, out = (v.aval.shape for v in (*eqn.invars[:2], eqn.outvars[0]))
    taps = 1
    for i, (lo, _) in enumerate(p["padding"]):
        n, k, m = lhs[lhs_spec[2 + i]], rhs[rhs_spec[2 + i]], out[out_spec[2 + i]]
        ld, rd, s = p["lhs_dilation"][i], p["rhs_dilation"][i], p["window_strides"][i]
        pos = np.arange(m)[:, None] * s + np.arange(k)[None, :] * rd - lo
        taps *= int(np.sum((pos >= 0) & (pos <= (n - 1) * ld) & (pos % ld == 0)))
    return 2.0 * out[out_spec[0]] * out[out_spec[1]] * rhs[rhs_spec[1]] * taps


def _shard_map_devices(params):
    """The devices a ``shard_map`` body runs on: the mesh's size over its manual axes."""
    mesh = params["mesh"]
    shape = dict(mesh.shape)
    if "newly_manual_axes" in params:  # jax 0.10 on: nested ones multiply in turn
        axes = params["newly_manual_axes"]
    elif "manual_axes" in params:
        axes = params["manual_axes"]
    elif "auto" in params:
        axes = set(shape) - set(params["auto"])
    else:
        raise NotImplementedError(
            f"redcoast.layout.flops: shard_map parameters {sorted(params)} on jax {jax.__version__} "
            "name no manual axes; the FLOP count needs updating for this jax")
    return math.prod(shape[a] for a in axes)


def _flops(eqn, total_of, counted=None):
    """One equation's FLOPs (``total_of``: a sub-program's, counted the same way); with
    ``counted``, only the products for which ``counted(eqn)`` is true."""
    name = eqn.primitive.name
    if name in (DOT, CONV) and counted is not None and not counted(eqn):
        return 0.0
    if name == DOT:
        return dot_general_flops(eqn)
    if name == CONV:
        return conv_flops(eqn)
    if name == "cond":
        return max(total_of(b) for b in eqn.params["branches"])
    if name == "scan":
        return eqn.params["length"] * total_of(eqn.params["jaxpr"])
    if name == "shard_map":
        return _shard_map_devices(eqn.params) * total_of(eqn.params["jaxpr"])
    # jit, remat, custom derivatives (their primal program: the rules are callables), while
    # (body and condition once), ...: every sub-program they hold runs once
    return sum(total_of(sub) for _, _, sub in sub_programs(eqn))


def jaxpr_flops(jaxpr, counted=None):
    """Matrix-product and convolution FLOPs of one run of ``jaxpr`` (a Jaxpr or ClosedJaxpr);
    with ``counted(eqn) -> bool``, of the products it picks only."""
    return float(total(jaxpr, lambda eqn, total_of: _flops(eqn, total_of, counted)))


def traced_flops(fn, *args):
    """Matrix-product and convolution FLOPs of one call of ``fn(*args)`` (arrays or
    ``jax.ShapeDtypeStruct``s), from its trace: nothing is compiled or run."""
    return jaxpr_flops(jax.make_jaxpr(fn)(*args))
