"""A numerical self-check of a layout: its loss and gradients on one batch against one device.

Everything redcoast does to a run (the sharding plan, FSDP, fused sibling matmuls, projections
stored permuted, the grouped-convolution guard) must leave the training step's numbers as the
user's ``loss_fn`` gives them on one device, up to floating-point summation order. A wrong
gradient trains without an error: this check is how one is found before a user finds it.

The reference runs the user's ``loss_fn`` as written (one model shard, no rewrite) on one device
of this process, with every parameter whole: the model must fit one device. With the user's own
``train_step_fn`` (which computes its gradient itself), the parameters after one update are
compared instead of the gradients.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .host import to_host
from .sharding.context import laid_out_for
from .sharding.paths import leaves_with_paths, path_to_str
from .steps import make_loss_and_grad


def default_rtol(compute_dtype):
    """Summation-order noise of a sharded step against one device: about 1e-6 in float32 on the
    models of the tests (the tolerance leaves room for deeper models); bfloat16 rounds each
    partial sum to 8 bits."""
    return 1e-4 if jnp.dtype(compute_dtype).itemsize >= 4 else 5e-2


@dataclasses.dataclass(frozen=True)
class LayoutCheck:
    """What :func:`check_layout` found: the errors of every compared value, worst first, each
    the largest absolute difference over the largest magnitude of the one-device value."""
    layout: str
    compared: str                # "gradients" or "parameters after one update"
    loss: float
    reference_loss: float
    errors: tuple                # ((name, relative error), ...), worst first
    rtol: float

    @property
    def ok(self):
        return all(e <= self.rtol for _, e in self.errors)

    @property
    def worst(self):
        return self.errors[0] if self.errors else ("(nothing compared)", 0.0)

    def __str__(self):
        verdict = "matches one device" if self.ok else "DIFFERS from one device"
        name, err = self.worst
        lines = [f"layout {self.layout} {verdict}: loss {self.loss:.7g} vs {self.reference_loss:.7g}, "
                 f"{self.compared} worst at {name} (relative error {err:.2e}, tolerance "
                 f"{self.rtol:.0e})."]
        bad = [(n, e) for n, e in self.errors if e > self.rtol]
        for n, e in bad[:10]:
            lines.append(f"  {n}: {e:.2e}")
        if len(bad) > 10:
            lines.append(f"  ... and {len(bad) - 10} more")
        return "\n".join(lines)


def relative_errors(values, reference, prefix=""):
    """``[(name, error)]`` worst first, over the leaves of two trees of one structure: the
    largest absolute difference over the largest magnitude of the reference leaf, or over a
    thousandth of the largest magnitude of all leaves where that is more. A leaf whose true
    value is 0 or nearly (the gradient of a key bias, which softmax ignores) holds only the
    rounding noise of a cancellation, which differs with the summation order of each layout:
    measured against itself it looks wrong (2e-4 on OPT and ViT at 2 x 4); a wrong gradient
    (a factor of the shard count, a missing sum) is off by its own size."""
    pairs = [(prefix + path_to_str(p), np.asarray(a, np.float64), np.asarray(b, np.float64))
             for (p, a), (_, b) in zip(leaves_with_paths(values), leaves_with_paths(reference))]
    scale = max((float(np.max(np.abs(b))) for _, _, b in pairs if b.size), default=0.0)
    floor = max(scale * 1e-3, np.finfo(np.float32).tiny)
    out = [(name, float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), floor))
           for name, a, b in pairs if b.size]
    return sorted(out, key=lambda x: -x[1])


def check_layout(layout, recipe, state, batch, rng, rtol=None):
    """A :class:`LayoutCheck` of ``layout`` (its loss and gradients on ``batch``, one micro-batch
    placed on its mesh) against the user's loss on one device. ``state``: the training state in
    the layout's storage (as the Trainer holds it), left unchanged."""
    rtol = default_rtol(recipe.compute_dtype) if rtol is None else rtol
    device = jax.local_devices()[0]
    one_state, one_batch, one_rng = jax.device_put(
        to_host((layout.stored.state_to_user(state), batch, rng)), device)
    if layout.grad_step is not None:
        loss, metrics, grads = layout.grad_step(state, batch, rng)
        ours = ({"loss": loss, **metrics}, layout.stored.params_to_user(grads))
        reference = make_loss_and_grad(laid_out_for(recipe.loss_fn, 1), recipe.compute_dtype)
        ref_loss, ref_metrics, ref_grads = jax.jit(reference)(one_state, one_state.params,
                                                              one_batch, one_rng)
        theirs = ({"loss": ref_loss, **ref_metrics}, ref_grads)
        compared, prefix = "gradients", "gradient of "
    else:  # the user's own step: the parameters after one update of a copy of the state
        copy = jax.jit(lambda s: jax.tree_util.tree_map(jnp.copy, s),
                       out_shardings=layout.state_shardings)(state)
        new_state, metrics = layout.train_step(copy, batch, rng)
        metrics = metrics if isinstance(metrics, dict) else {}
        ours = (metrics, layout.stored.params_to_user(new_state.params))
        ref_state, ref_metrics = jax.jit(recipe.train_step_fn)(one_state, one_batch, one_rng)
        theirs = (ref_metrics if isinstance(ref_metrics, dict) else {}, ref_state.params)
        compared, prefix = "parameters after one update", "parameter after one update: "
    (scalars, leaves), (ref_scalars, ref_leaves) = to_host(ours), to_host(theirs)
    errors = relative_errors(scalars, ref_scalars, prefix="metric ") \
        + relative_errors(leaves, ref_leaves, prefix=prefix)
    return LayoutCheck(layout.name, compared, float(scalars.get("loss", np.nan)),
                       float(ref_scalars.get("loss", np.nan)),
                       tuple(sorted(errors, key=lambda x: -x[1])), rtol)
