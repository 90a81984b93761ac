"""A numerical self-check of a layout: its loss and gradients on one batch against one device.

Everything redcoast does to a run (the sharding plan, FSDP, fused sibling matmuls, projections
stored permuted, the grouped-convolution guard) must leave the training step's numbers as the
user's ``loss_fn`` gives them on one device, up to floating-point summation order. A wrong
gradient trains without an error: this check is how one is found before a user finds it.

The reference runs the user's ``loss_fn`` as written (one model shard, no rewrite) on one device
of this process, with every parameter whole: the model must fit one device. With the user's own
``train_step_fn`` (which computes its gradient itself), the parameters after one update are
compared instead of the gradients.

How far apart is "up to floating-point summation order" depends on the model as much as on the
layout: a pretrained 30-layer LM's gradient moves by 2e-4 of its size when its parameters move by
one rounding (1e-7), so no fixed tolerance fits every model. The check measures that sensitivity on
the reference itself (its gradients at parameters rounded differently, one unit in the last place at
random) and lets every value differ by ``NOISE_FACTOR`` times its largest change where that is
more than ``rtol``; a wrong rewrite (a factor of the shard count, a missing sum) is far above both.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError, LayoutCheckError
from ..multihost.host import to_host
from ..sharding.axes import DATA_AXIS
from ..sharding.context import laid_out_for
from ..sharding.paths import leaves_with_paths, path_to_str
from .steps import make_loss_and_grad


# a sharded layout's worst error over the worst change one rounding of the parameters makes:
# 0.6x (mp=4), 1.2x (mp=2), 1.0x (mp=8) on pretrained SmolLM2-135M's gradients (worst change
# 2.4e-4, errors 1.4e-4 to 2.6e-4), 0.8x on tests' chaotic MLP; float32
NOISE_FACTOR = 10


def default_rtol(compute_dtype):
    """The tolerance's floor: summation-order noise of a sharded step against one device is about
    1e-6 in float32 on the tests' small models (deeper, pretrained ones are judged by their own
    rounding noise, above); bfloat16 rounds each partial sum to 8 bits."""
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
    noise: float = 0.0           # the reference's largest change for one rounding of the params

    @property
    def tolerance(self):
        """What each value may differ by: ``rtol``, or ``NOISE_FACTOR`` x the reference's own
        sensitivity where that is more."""
        return max(self.rtol, NOISE_FACTOR * self.noise)

    @property
    def ok(self):
        return all(e <= self.tolerance for _, e in self.errors)

    @property
    def worst(self):
        return self.errors[0] if self.errors else ("(nothing compared)", 0.0)

    def __str__(self):
        verdict = "matches one device" if self.ok else "DIFFERS from one device"
        name, err = self.worst
        lines = [f"layout {self.layout} {verdict}: loss {self.loss:.7g} vs {self.reference_loss:.7g}, "
                 f"{self.compared} worst at {name} (relative error {err:.2e}, tolerance "
                 f"{self.tolerance:.1e}: {self.rtol:.0e}, or {NOISE_FACTOR}x the {self.noise:.1e} "
                 f"that one rounding of the parameters moves them on one device where that is more)."]
        bad = [(n, e) for n, e in self.errors if e > self.tolerance]
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


def rounded_differently(params, seed=0):
    """``params`` (on the host) with every floating-point value moved by about one unit in its
    last place, up or down at random: what one more rounding would have done to it."""
    rng = np.random.default_rng(seed)

    def move(x):
        x = np.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        sign = np.where(rng.random(x.shape) < 0.5, -1.0, 1.0).astype(np.float32)
        return (x.astype(np.float32) * (1 + sign * float(jnp.finfo(x.dtype).eps))).astype(x.dtype)
    return jax.tree_util.tree_map(move, params)


def first_rows(examples, collate_fn, per_device_batch_size, mesh):
    """The first ``per_device_batch_size`` x data shards of ``examples`` (a sequence), placed
    on ``mesh``: the micro-batch a layout is checked on."""
    from ..data import BatchMaker, global_batch_size, is_sequence
    if not is_sequence(examples):
        raise ConfigError(f"check_layout takes a sequence of examples (a list, a Dataset), "
                          f"not {type(examples).__name__}. Fix: pass list(...) of a few batches.")
    n = global_batch_size(per_device_batch_size, mesh)
    if len(examples) < n:
        raise ConfigError(f"check_layout needs {n} examples (per_device_batch_size="
                          f"{per_device_batch_size} x {mesh.shape[DATA_AXIS]} data shards); "
                          f"{len(examples)} were given.")
    return BatchMaker(mesh, collate_fn, n).make(examples, np.arange(n))


def check_or_raise(layout, recipe, state, batch, rng, rtol=None):
    """:func:`check_layout`, raising :class:`LayoutCheckError` (with what to do) if it fails."""
    report = check_layout(layout, recipe, state, batch, rng, rtol)
    if not report.ok:
        raise LayoutCheckError(
            f"{report}\nThis is a bug in redcoast's layout (please report it with this "
            "message). Until it is fixed, train in a layout that passes this check: try "
            "fuse_matmuls=False, then fsdp=False, then n_model_shards=1.")
    return report


def check_layout(layout, recipe, state, batch, rng, rtol=None):
    """A :class:`LayoutCheck` of ``layout`` (its loss and gradients on ``batch``, one micro-batch
    placed on its mesh) against the user's loss on one device. ``state``: the training state in
    the layout's storage (as the Trainer holds it), left unchanged."""
    rtol = default_rtol(recipe.compute_dtype) if rtol is None else rtol
    device = jax.local_devices()[0]
    host_state, host_batch, host_rng = to_host((layout.stored.state_to_user(state), batch, rng))
    one_state, one_batch, one_rng = jax.device_put((host_state, host_batch, host_rng), device)
    moved_params = jax.device_put(rounded_differently(host_state.params), device)
    if layout.grad_step is not None:
        loss, metrics, grads = layout.grad_step(state, batch, rng)
        ours = ({"loss": loss, **metrics}, layout.stored.params_to_user(grads))
        reference = jax.jit(make_loss_and_grad(laid_out_for(recipe.loss_fn, 1),
                                               recipe.compute_dtype))
        ref_loss, ref_metrics, ref_grads = reference(one_state, one_state.params, one_batch,
                                                     one_rng)
        theirs = ({"loss": ref_loss, **ref_metrics}, ref_grads)
        moved = reference(one_state, moved_params, one_batch, one_rng)
        moved = ({"loss": moved[0], **moved[1]}, moved[2])
        compared, prefix = "gradients", "gradient of "
    else:  # the user's own step: the parameters after one update of a copy of the state
        copy = jax.jit(lambda s: jax.tree_util.tree_map(jnp.copy, s),
                       out_shardings=layout.state_shardings)(state)
        new_state, metrics = layout.train_step(copy, batch, rng)
        metrics = metrics if isinstance(metrics, dict) else {}
        ours = (metrics, layout.stored.params_to_user(new_state.params))
        reference = jax.jit(recipe.train_step_fn)
        ref_state, ref_metrics = reference(one_state, one_batch, one_rng)
        theirs = (ref_metrics if isinstance(ref_metrics, dict) else {}, ref_state.params)
        moved_state, moved_metrics = reference(one_state.replace(params=moved_params), one_batch,
                                               one_rng)
        moved = (moved_metrics if isinstance(moved_metrics, dict) else {}, moved_state.params)
        compared, prefix = "parameters after one update", "parameter after one update: "
    (scalars, leaves), (ref_scalars, ref_leaves) = to_host(ours), to_host(theirs)
    moved_scalars, moved_leaves = to_host(moved)

    def compare(scalars, leaves):
        return relative_errors(scalars, ref_scalars, prefix="metric ") \
            + relative_errors(leaves, ref_leaves, prefix=prefix)
    errors = compare(scalars, leaves)
    return LayoutCheck(layout.name, compared, float(scalars.get("loss", np.nan)),
                       float(ref_scalars.get("loss", np.nan)),
                       tuple(sorted(errors, key=lambda x: -x[1])), rtol,
                       max((e for _, e in compare(moved_scalars, moved_leaves)), default=0.0))
