"""The jitted functions of a run: the training step, the evaluation step, the prediction step.

Each is a pure function of (state or params, batch, rng); the Trainer and Predictor compile them
with explicit shardings. Mixed precision: parameters are kept (and updated) in their own dtype
(fp32 master weights); ``compute_dtype`` is what ``loss_fn`` sees, so its forward and backward
run in that dtype while gradients arrive, are accumulated and are applied in fp32.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from ..errors import LossError
from ..sharding.axes import MODEL_AXIS
from ..sharding.batch_split import split_batches_of_whole_weights
from ..sharding.fusion import fuse_sibling_matmuls
from ..sharding.grouped_conv import guard_grouped_convs
from ..sharding.paths import leaves_with_paths
from ..sharding.remat_weights import gather_in_remat, gathered_in_remat
from ..sharding.scanned_weights import gather_layer_by_layer, scanned_leaves
from ..sharding.stationary_weights import left_to_partitioner
from .cost_model import flops_per_link_byte


# optax.tree.norm replaced optax.global_norm (deprecated since optax 0.2.5)
_tree_norm = optax.tree.norm if hasattr(getattr(optax, "tree", None), "norm") else optax.global_norm


def cast_floating(tree, dtype):
    """Cast floating-point leaves to ``dtype``; integer leaves are left alone."""
    if dtype is None:
        return tree
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def split_loss_output(output):
    """``loss_fn``'s output as (scalar fp32 loss, dict of scalar fp32 metrics), or a clear error."""
    if isinstance(output, (tuple, list)) and len(output) == 2 and isinstance(output[1], dict):
        loss, metrics = output
    else:
        loss, metrics = output, {}
    if loss is None:
        raise LossError(
            "loss_fn returned None; it must return a scalar loss or (scalar loss, dict of scalar "
            "metrics). Fix: return the loss on every path of loss_fn, for is_training=True and "
            "False alike.")
    try:
        loss = jnp.asarray(loss)
    except TypeError as e:
        raise LossError(
            f"loss_fn returned {type(loss).__name__}; it must return a scalar loss or "
            "(scalar loss, dict of scalar metrics).") from e
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise LossError(
            f"loss_fn returned a loss of dtype {loss.dtype}; it must be floating-point, or every "
            "gradient is zero and nothing trains. Fix: compute the loss in floats (e.g. "
            "`.astype(jnp.float32)` before reducing, not after rounding or argmax).")
    if loss.shape != ():
        raise LossError(
            f"loss_fn returned a loss of shape {loss.shape}; it must be a scalar. Fix: reduce it, "
            "e.g. `return jnp.mean(per_example_loss)`, and return metrics as "
            "(loss, {'name': scalar}).")
    out_metrics = {}
    for name, value in metrics.items():
        value = jnp.asarray(value)
        if value.shape != ():
            raise LossError(
                f"loss_fn returned metric '{name}' of shape {value.shape}; metrics must be "
                f"scalars. Fix: reduce '{name}' (e.g. with jnp.mean) inside loss_fn.")
        out_metrics[name] = value.astype(jnp.float32)
    if "loss" in out_metrics:
        raise LossError("loss_fn returned a metric named 'loss', which redcoast reserves for the "
                        "loss itself. Fix: rename that metric.")
    return loss.astype(jnp.float32), out_metrics


def gathered(params, compute_dtype, compute_shardings=None):
    """``params`` in ``compute_dtype``, each constrained to the sharding the step uses it in.

    A parameter stored split over 'dp' (FSDP) is thereby all-gathered once, explicitly, where the
    loss uses it, and its gradient reduce-scattered; left to propagation, XLA may instead carry
    the split into the activations and reshard those (measured: 1.5x step time on 4x2), which
    pays only where those are smaller than the weight (sharding/stationary_weights.py: such
    leaves come with an unconstrained sharding).
    """
    params = cast_floating(params, compute_dtype)
    if compute_shardings is None:
        return params
    return jax.lax.with_sharding_constraint(params, compute_shardings)


def _stored_otherwise(compute_shardings, stored_shardings, params):
    """The indices of the parameter leaves stored otherwise than the step computes with them
    (FSDP's)."""
    if compute_shardings is None or stored_shardings is None:
        return set()
    return {i for i, (c, s, p) in enumerate(zip(
        jax.tree_util.tree_leaves(compute_shardings), jax.tree_util.tree_leaves(stored_shardings),
        jax.tree_util.tree_leaves(params))) if not s.is_equivalent_to(c, np.ndim(p))}


def _gathered_in_scans(closed, weights, compute_shardings, stored_shardings):
    """``(shardings the loss starts from, {leaf: one layer's (stored, computed) specs})``: the
    parameters that a scan of the loss's program ``closed`` runs over, and that are stored
    otherwise than computed (FSDP), start as stored and stay so as each iteration takes its
    layer, gathered where the layer is used (sharding/scanned_weights.py); the others are
    gathered at the start (:func:`gathered`)."""
    compute, treedef = jax.tree_util.tree_flatten(compute_shardings)
    stored = treedef.flatten_up_to(stored_shardings)
    moved = {i for i in scanned_leaves(closed, weights)
             if not stored[i].is_equivalent_to(compute[i], len(weights[i].shape))}
    if not moved:
        return compute_shardings, {}
    starts = [stored[i] if i in moved else s for i, s in enumerate(compute)]
    return (jax.tree_util.tree_unflatten(treedef, starts),
            {i: (tuple(stored[i].spec)[1:], tuple(compute[i].spec)[1:]) for i in moved})


def _unconstrained(shardings, leaves, params):
    """``shardings`` with the leaves at ``leaves`` (indices) left to the partitioner."""
    flat, treedef = jax.tree_util.tree_flatten(shardings)
    ndims = [np.ndim(p) for p in jax.tree_util.tree_leaves(params)]
    flat = [NamedSharding(s.mesh, P(*[P.UNCONSTRAINED] * ndims[i])) if i in leaves else s
            for i, s in enumerate(flat)]
    return jax.tree_util.tree_unflatten(treedef, flat)


def with_frozen_cast(state, compute_dtype):
    """``state`` with its ``frozen_params`` (if any) in ``compute_dtype``, as ``loss_fn`` sees them."""
    if state.frozen_params is None:
        return state
    return state.replace(frozen_params=cast_floating(state.frozen_params, compute_dtype))


def _split_by_batch(fn, batch, mesh, plan, training):
    """``fn(params, batch, ...)`` with the matmuls of weights ``plan`` keeps whole over the model
    shards run on a share of ``batch`` per device where that pays (sharding/batch_split.py)."""
    if mesh is None or plan is None:
        return fn
    rows = [np.shape(x)[0] for x in jax.tree_util.tree_leaves(batch) if np.ndim(x)]
    return split_batches_of_whole_weights(fn, mesh, plan, rows[0], flops_per_link_byte(mesh),
                                          training=training) if rows else fn


def make_loss_and_grad(loss_fn, compute_dtype, rewrite_plan=None, compute_shardings=None,
                       mesh=None, guard_plan=None, stored_shardings=None):
    """``loss_and_grad(state, params, batch, rng) -> (loss, metrics, grads)``: the training
    loss of one micro-batch and its gradient, as the training step computes them.

    ``rewrite_plan`` (a ``RewritePlan`` of the parameters' plan, sharding/rewrite_plan.py; used
    with more than one model shard) runs the loss with sibling matmuls (Q/K/V, gate/up: one
    input) of the weights the plan splits fused into one, so that under tensor parallelism the
    backward pass all-reduces their input gradient once, as Megatron-LM does (and the other
    rewrites of sharding/fusion.py). ``compute_shardings`` (``plan.compute_shardings()``):
    where the loss uses each parameter (see :func:`gathered`). ``mesh``: the mesh the step runs
    on; its grouped convolutions are then guarded against the partitioner's wrong kernel
    gradient (sharding/grouped_conv.py), with their channels split where ``guard_plan`` (the
    ``RewritePlan`` of the parameters' plan, whether or not the loss is rewritten) splits
    their kernels. ``stored_shardings`` (the parameters' own): a stacked parameter that a scan
    runs over and FSDP stores split is gathered one layer at a time inside the scan, not whole
    at the start (sharding/scanned_weights.py).
    """
    def training_loss(p, batch, rng, state, shardings):
        return loss_fn(rng, with_frozen_cast(state, compute_dtype),
                       gathered(p, compute_dtype, shardings), batch, True)

    def objective_of(state, params, batch, rng):
        shardings, layer_specs, remat_specs = compute_shardings, {}, {}
        split = _stored_otherwise(compute_shardings, stored_shardings, params)
        if mesh is not None and guard_plan is not None and guard_plan.knows_placements and split:
            weights = guard_plan.leaf_splits(leaves_with_paths(params))
            closed = jax.make_jaxpr(lambda p: training_loss(p, batch, rng, state, None))(params)
            shardings, layer_specs = _gathered_in_scans(closed, weights, compute_shardings,
                                                        stored_shardings)
            shardings, remat_specs = gathered_in_remat(closed, weights, shardings,
                                                       compute_shardings, stored_shardings)
            shardings = _unconstrained(shardings, left_to_partitioner(
                closed, weights, mesh.shape.get(MODEL_AXIS, 1)) & split, params)
        if (mesh is not None and mesh.shape.get(MODEL_AXIS, 1) == 1 and not layer_specs
                and not remat_specs):
            # one model shard: FSDP's gathers left to XLA, which gathers in the compute dtype
            # and sums each gradient where it is made; gathered here first, XLA:CPU gathered
            # fp32 and all-reduced the whole fp32 gradient at once (SmolLM2-135M, 8x1, bf16:
            # 2.0x the step, 1394 against 739 MiB; B1 at 8x1: 1.09x -> 1.02x the hand step)
            shardings = None
        fn = lambda p, b, r: training_loss(p, b, r, state, shardings)  # noqa: E731
        if remat_specs:  # cast and kept as stored here, gathered in the layers (remat_weights.py)
            inner = gather_in_remat(lambda p, b, r: loss_fn(
                r, with_frozen_cast(state, compute_dtype), p, b, True), mesh, remat_specs)
            fn = lambda p, b, r: inner(gathered(p, compute_dtype, shardings), b, r)  # noqa: E731
        if layer_specs:
            fn = gather_layer_by_layer(fn, mesh, weights, layer_specs)
        if mesh is None:
            return fn
        fn = guard_grouped_convs(fn, mesh, plan=guard_plan)
        return _split_by_batch(fn, batch, mesh, guard_plan, training=True)

    def loss_and_grad(state, params, batch, rng):
        loss = objective_of(state, params, batch, rng)

        def objective(p):
            if rewrite_plan is not None and rewrite_plan.blocks > 1:
                try:
                    return split_loss_output(fuse_sibling_matmuls(loss, rewrite_plan)(p, batch, rng))
                except LossError:
                    raise
                except Exception as e:  # noqa: BLE001 - a program the rewrite cannot run: as written
                    # the loss's own errors surface from this unfused trace, as written
                    out = split_loss_output(loss(p, batch, rng))
                    warnings.warn(f"redcoast could not fuse the loss's sibling matmuls "
                                  f"({type(e).__name__}: {e}); the step runs as written, which "
                                  "may move more bytes between model shards.", stacklevel=2)
                    return out
            return split_loss_output(loss(p, batch, rng))
        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return loss, metrics, grads

    return loss_and_grad


def make_train_step(loss_fn, compute_dtype, accumulate_grad_batches, grad_shardings=None,
                    rewrite_plan=None, compute_shardings=None, log_grad_norm=False, mesh=None,
                    guard_plan=None):
    """``step(state, batch, rng) -> (state, metrics)``: one optimizer update.

    With ``accumulate_grad_batches`` k > 1 the batch has a leading axis of k micro-batches and
    the gradient is their mean, computed in one compiled loop. ``state.nonfinite_step`` records
    the first step whose loss was not finite. ``rewrite_plan``, ``compute_shardings``, ``mesh``
    and ``guard_plan``: see :func:`make_loss_and_grad`. ``log_grad_norm`` adds the global norm of the
    (averaged) gradient to the metrics as ``grad_norm``.
    """
    loss_and_grad = make_loss_and_grad(loss_fn, compute_dtype, rewrite_plan, compute_shardings, mesh,
                                       guard_plan, stored_shardings=grad_shardings)

    def step(state, batch, rng):
        step_rng = jax.random.fold_in(rng, state.step)
        if accumulate_grad_batches == 1:
            loss, metrics, grads = loss_and_grad(state, state.params, batch, jax.random.fold_in(step_rng, 0))
        else:
            def micro(carry, xs):
                micro_batch, i = xs
                loss, metrics, grads = loss_and_grad(state, state.params, micro_batch,
                                                     jax.random.fold_in(step_rng, i))
                total = jax.tree_util.tree_map(jnp.add, carry, (loss, metrics, grads))
                if grad_shardings is not None:  # keep the running sum sharded like the params
                    total = (total[0], total[1], jax.lax.with_sharding_constraint(total[2], grad_shardings))
                return total, None

            zeros = jax.eval_shape(lambda: loss_and_grad(state, state.params,
                                                         jax.tree_util.tree_map(lambda x: x[0], batch), step_rng))
            zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
            (loss, metrics, grads), _ = jax.lax.scan(
                micro, zeros, (batch, jnp.arange(accumulate_grad_batches)))
            loss, metrics, grads = jax.tree_util.tree_map(
                lambda x: x / accumulate_grad_batches, (loss, metrics, grads))

        # From the first non-finite loss on, no update is applied: the gradients and the updates
        # are zeroed, so the parameters stay the last finite ones exactly (the optimizer's moments
        # see a zero gradient; that state is never saved, see Trainer._check_finite). Selects on
        # the gradients and updates mostly fuse into the optimizer's elementwise update: no extra
        # memory or time on nonfinite_guard.py's MLP, where a select over the new state (or a
        # lax.cond) added temporary buffers and time (benchmarks/nonfinite_guard.py). Not free
        # everywhere: on XLA:CPU at a 1B Llama's width (4 layers, 8x1) the gradients' select
        # held 17 MiB more temporaries a device and the updates' 3.5 (2% of the step's peak).
        ok = (state.nonfinite_step < 0) & jnp.isfinite(loss)
        grads = jax.tree_util.tree_map(lambda g: jnp.where(ok, g, jnp.zeros_like(g)), grads)
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        updates = jax.tree_util.tree_map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
        params = optax.apply_updates(state.params, updates)
        # The host checks the flag at every logging interval and before any save.
        first_bad = jnp.where((state.nonfinite_step < 0) & ~jnp.isfinite(loss),
                              state.step, state.nonfinite_step)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  nonfinite_step=first_bad)
        metrics = {"loss": loss, **metrics}
        if log_grad_norm:
            if "grad_norm" in metrics:
                raise LossError("loss_fn returned a metric named 'grad_norm', which "
                                "log_grad_norm=True reserves for the gradient's norm. Fix: rename "
                                "that metric.")
            metrics["grad_norm"] = _tree_norm(grads).astype(jnp.float32)
        return new_state, metrics

    return step


def make_eval_step(loss_fn, compute_dtype, compute_shardings=None, mesh=None, split_plan=None):
    """``step(state, batch, mask, rng) -> (sums, count, spread)``: example-weighted loss and
    metrics.

    ``loss_fn`` is applied to each example as a batch of one (vectorised with ``vmap``), so the
    result is the mean over examples whatever the batch size, and padded rows (``mask`` False)
    count for nothing. ``spread``: the smallest and largest loss of the real rows (equal losses
    for different examples hint at a loss defined over the batch, see
    :func:`make_batch_eval_step`). With ``mesh`` and ``split_plan`` (the ``RewritePlan`` of the
    parameters' plan), the matmuls of weights kept whole over the model shards run on a share
    of the batch each, as in training (sharding/batch_split.py).
    """
    def step(state, batch, mask, rng):
        state = with_frozen_cast(state, compute_dtype)

        def losses_of(stored, batch):
            params = gathered(stored, compute_dtype, compute_shardings)

            def one(example):
                example = jax.tree_util.tree_map(lambda x: x[None], example)
                return split_loss_output(loss_fn(rng, state, params, example, False))
            return jax.vmap(one)(batch)

        losses, metrics = _split_by_batch(losses_of, batch, mesh, split_plan,
                                          training=False)(state.params, batch)
        weights = mask.astype(jnp.float32)
        sums = {"loss": jnp.sum(losses * weights),
                **{k: jnp.sum(v * weights) for k, v in metrics.items()}}
        spread = (jnp.min(jnp.where(mask, losses, jnp.inf)), jnp.max(jnp.where(mask, losses, -jnp.inf)))
        return sums, jnp.sum(weights), spread

    return step


def make_batch_eval_step(loss_fn, compute_dtype, compute_shardings=None, mesh=None,
                         split_plan=None):
    """``step(state, batch, rng) -> (sums, count)``: ``loss_fn`` applied to the whole batch, as
    a loss defined over the batch needs (a contrastive loss is 0 on a batch of one); ``sums``
    are its loss and metrics times the batch's rows, every row real. ``mesh``, ``split_plan``:
    as for :func:`make_eval_step`."""
    def step(state, batch, rng):
        def loss_of(stored, batch):
            return loss_fn(rng, with_frozen_cast(state, compute_dtype),
                           gathered(stored, compute_dtype, compute_shardings), batch, False)

        loss, metrics = split_loss_output(_split_by_batch(loss_of, batch, mesh, split_plan,
                                                          training=False)(state.params, batch))
        rows = jnp.float32(jax.tree_util.tree_leaves(batch)[0].shape[0])
        return {"loss": loss * rows, **{k: v * rows for k, v in metrics.items()}}, rows

    return step
