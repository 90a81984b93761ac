"""Whether the loss multiplies in the precision the Trainer was asked for.

``compute_dtype=jnp.bfloat16`` hands the loss bfloat16 parameters (the float32 master weights stay
in the state). A model whose own ``dtype`` is float32 casts them back up (a Flax module computes
in its ``dtype``), so its matrix products run in float32: float32's speed and activation memory
with weights rounded to bfloat16. Nothing fails and the loss looks right, so the first batch says
so (issue 51: a benchmark of this project's own measured float32 products for weeks this way).
"""

import jax
import jax.numpy as jnp

from .flops import jaxpr_flops
from .steps import cast_floating, with_frozen_cast

# the share of matrix-product FLOPs in a wider dtype than asked for above which the run is told:
# a model that keeps its logits or attention scores in float32 on purpose stays well below
WIDER_SHARE = 0.5


def _wider_than(dtype):
    """``counted(eqn)`` for :func:`jaxpr_flops` (which asks it of matrix products and
    convolutions only): one of the two operands is wider than ``dtype``."""
    itemsize = jnp.dtype(dtype).itemsize

    def counted(eqn):
        return any(jnp.issubdtype(v.aval.dtype, jnp.floating) and v.aval.dtype.itemsize > itemsize
                   for v in eqn.invars[:2])
    return counted


def wider_products_note(loss_fn, compute_dtype, state, abstract_batch):
    """None, or what to tell a run whose loss multiplies most of its FLOPs in a dtype wider
    than ``compute_dtype`` (traced on the abstract first batch: nothing is compiled or run)."""
    compute_dtype = jnp.dtype(compute_dtype)
    if not jnp.issubdtype(compute_dtype, jnp.floating) or compute_dtype.itemsize >= 4:
        return None
    frozen = with_frozen_cast(state, compute_dtype)

    def loss(params, batch):
        return loss_fn(jax.random.PRNGKey(0), frozen, cast_floating(params, compute_dtype),
                       batch, True)

    closed = jax.make_jaxpr(loss)(state.params, abstract_batch)
    everything = jaxpr_flops(closed)
    wider = jaxpr_flops(closed, counted=_wider_than(compute_dtype))
    if not everything or wider / everything <= WIDER_SHARE:
        return None
    return (f"compute_dtype={compute_dtype.name} gives the loss {compute_dtype.name} parameters, "
            f"but {wider / everything:.0%} of its matrix-product FLOPs multiply wider operands: "
            "the model casts the parameters back up (a Flax module computes in its `dtype`, or "
            "promotes to its widest input), so the step runs at float32's speed and activation "
            f"memory with {compute_dtype.name}-rounded weights. For {compute_dtype.name} compute "
            f"build the model with dtype=jnp.{compute_dtype.name} (redcoast.models: the config's "
            "`dtype`; transformers' Flax models: from_pretrained(..., "
            f"dtype=jnp.{compute_dtype.name})); to train in float32, leave compute_dtype at "
            "float32")
