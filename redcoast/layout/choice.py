"""The layout a Trainer runs in, chosen once at its first batch and said in the log."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from ..errors import ConfigError
from ..multihost import placement
from ..sharding.axes import DATA_AXIS
from ..sharding.dataflow import FALLBACK
from ..sharding.plan import splits_over_model_shards
from ..store import user_cache
from ..store.workdir import is_url
from .abstract import placed, shapes_of
from .layout import Recipe, choose_layout
from .precision import wider_products_note
from .remembered import LayoutMemory


def choose_run_layout(recipe: Recipe, state, train_key, deployer, options: Mapping,
                      batch_for: Callable):
    """The final layout for ``state``, from the loss traced on the first batch (``batch_for
    (mesh)``: an abstract first micro-batch on ``mesh``) among ``options`` (``{"fsdp": [...],
    "fuse_matmuls": [...]}``) and the deployer's shard counts; what was chosen, and why, logged."""
    shard_counts = (deployer.model_shard_candidates() if deployer.n_model_shards_requested == "auto"
                    else [deployer.n_model_shards])
    memory = _layout_memory(recipe, deployer, options, shard_counts)
    started = time.perf_counter()
    layout = choose_layout(recipe, state, train_key, shard_counts, options["fsdp"],
                           options["fuse_matmuls"], batch_for, deployer.mesh_for,
                           deployer.device_memory_budget(), deployer.platform, memory)
    if len(layout.considered) > 1:
        deployer.log_info(
            f"choosing the layout compiled {len(layout.considered)} candidate steps in "
            f"{time.perf_counter() - started:.1f} s"
            + (f"; the choice is remembered in {' and '.join(memory.places())} for the next run"
               if memory else "; a workdir would remember it for the next run")
            + f" (Deployer(n_model_shards={layout.n_model_shards}) skips the comparison).")
    if layout.source.startswith(FALLBACK):  # said always, not only in verbose runs
        deployer.log_warning(f"sharding plan from {layout.source}")
    frozen_split = _frozen_split_over_model_shards(layout)  # LoRA: the base is split
    if len(shard_counts) == 1 and layout.plan.nothing_to_split(frozen_split):  # said always
        deployer.log_warning(layout.plan.nothing_to_split(frozen_split) + ".")
    elif short := layout.plan.short_of_megatron(frozen_split):  # said always
        deployer.log_warning(short + ".")
    if recipe.train_step_fn is None and (
            wider := wider_products_note(recipe.loss_fn, recipe.compute_dtype, state,
                                         batch_for(layout.mesh))):  # said always
        deployer.log_warning(wider + ".")
    if len(shard_counts) > 1:  # said always: the run's mesh is not the one the deployer began with
        deployer.log_info(f"n_model_shards='auto' chose {layout.n_model_shards} (mesh dp="
                          f"{layout.n_data_shards} x mp={layout.n_model_shards}): {layout.reason}.")
    if deployer.verbose:
        if layout.table:
            deployer.log_info(f"{layout.name}: {layout.reason}.\n{layout.table}",
                              title="Layout (candidates compiled for the first batch)")
        deployer.log_info(layout.plan.table(frozen_split),
                          title=f"Sharding plan (from {layout.source})")
        deployer.log_info(layout.plan.rules_source(), title="As params_sharding_rules:")
    return layout


def batches_like(example_batch, accumulate_grad_batches: int, n_data_shards: int) -> Callable:
    """``batch_for(mesh)``: an abstract micro-batch shaped like ``example_batch`` (a global
    batch for ``n_data_shards``, with the micro-batch axis first when accumulating) with the same
    rows per data shard on ``mesh`` ('auto' trying other numbers of shards)."""
    k = accumulate_grad_batches
    if k > 1:
        leading = {tuple(x.shape[:1]) for x in jax.tree_util.tree_leaves(example_batch)}
        if leading != {(k,)}:
            raise ConfigError(
                f"accumulate_grad_batches={k}: the example batch's arrays lead with "
                f"{sorted(leading)}, not the {k} micro-batches of one update. Fix: stack {k} "
                "micro-batches as collate_fn returns them (np.stack([...]) on a new first axis), "
                "as compile_train_step and step_cost take one update's batch.")
    micro = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if k > 1 else x, example_batch)
    return lambda mesh: jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(
        (x.shape[0] * mesh.shape[DATA_AXIS] // n_data_shards, *x.shape[1:]), x.dtype), micro)


def moved_to(layout, old, state, abstract: bool, keys: tuple, fresh_opt_state: bool = False
             ) -> tuple:
    """``(state, keys)`` moved from layout ``old`` to ``layout`` (the state donated: a model may
    fill the devices); between layouts the state is in the user's layout. On shapes alike.
    ``fresh_opt_state``: the optimizer state is still ``tx.init(params)`` (nothing stepped,
    restored or given): it is made again in ``layout`` rather than moved, which costs one
    program instead of a transfer per array (Adam's two moments are 2/3 of the state)."""
    if abstract:
        user = jax.eval_shape(old.stored.state_to_user, state)
        state = shapes_of(layout.stored.state_to_storage,
                          placed(user, layout.state_shardings), layout.state_shardings)
        return state, placed(keys, (layout.replicated, layout.replicated))
    user = old.stored.state_to_user(state)
    if not fresh_opt_state:
        state = layout.stored.state_to_storage(
            placement.device_put(user, layout.state_shardings, donate=True))
        return state, placement.device_put(keys, layout.replicated)
    shardings = layout.state_shardings
    _drop_made_here(user.opt_state, keep=user.params)  # freed before anything new is placed
    moved = _resharded(user.replace(opt_state=()), shardings.replace(opt_state=()))
    opt_state = jax.jit(moved.tx.init, out_shardings=shardings.opt_state)(moved.params)
    state = layout.stored.state_to_storage(moved.replace(opt_state=opt_state))
    return state, placement.device_put(keys, layout.replicated)


def _resharded(tree, shardings):
    """``tree`` (donated) on ``shardings`` by one compiled program: dispatched without waiting
    for the arrays (``jax.device_put`` of a donated array waits until it is computed, so a
    model's random initialisation still running blocked the trace and compiles that follow:
    14 s of a 1B-wide Llama's first update at 4 x 2). One program, its collectives in one
    order on every process.

    Only the arrays whose pieces keep their shape are donated: XLA can reuse no other input's
    buffer for an output (JAX warns that such donations were not usable, on every run that
    moved the state). The rest are deleted once the program is dispatched, which frees them as
    it ends, as donating them did."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    targets = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda _, s: s, tree, shardings))
    reusable = [isinstance(x, jax.Array)
                and x.sharding.shard_shape(x.shape) == s.shard_shape(x.shape)
                for x, s in zip(leaves, targets)]

    def part(items, donated: bool) -> list:
        return [item for item, r in zip(items, reusable) if r == donated]

    outputs = jax.jit(lambda donated, copied: (donated, copied), donate_argnums=0,
                      out_shardings=(part(targets, True), part(targets, False)))(
        part(leaves, True), part(leaves, False))
    for x in part(leaves, False):
        if isinstance(x, jax.Array):
            x.delete()
    donated, copied = map(iter, outputs)
    return jax.tree_util.tree_unflatten(
        treedef, [next(donated) if r else next(copied) for r in reusable])


def _drop_made_here(tree, keep) -> None:
    """Free the buffers of ``tree`` that are not among ``keep``'s: an optimizer state may hold
    the parameters themselves (lookahead's slow copy) should a jitted ``tx.init`` ever return its
    input as its output (jax 0.10-0.12 copy it)."""
    kept = {id(x) for x in jax.tree_util.tree_leaves(keep)}
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array) and id(x) not in kept and not x.is_deleted():
            x.delete()


def _layout_memory(recipe: Recipe, deployer, options: Mapping, shard_counts) -> LayoutMemory | None:
    """Where this run's layout choice is remembered (the workdir's layout.json and the per-user
    cache, user_cache.py), with what it depends on besides the parameters and the batch; None
    with neither (no local workdir, the cache off or several processes)."""
    workdir = deployer.workdir
    if workdir is not None and is_url(workdir):  # remote workdirs: not written here
        workdir = None
    cache_dir = user_cache.layouts_directory()
    if workdir is None and cache_dir is None:
        return None
    key = {"shard_counts": list(shard_counts), "fsdp": list(options["fsdp"]),
           "fuse_matmuls": list(options["fuse_matmuls"]),
           "compute_dtype": str(jnp.dtype(recipe.compute_dtype)),
           "accumulate": recipe.accumulate_grad_batches,
           "budget": deployer.device_memory_budget(),
           "own_train_step": recipe.train_step_fn is not None}
    return LayoutMemory.in_workdir(workdir, key, deployer.devices, cache_dir, deployer.log_warning)


def _frozen_split_over_model_shards(layout):
    """Whether any of the frozen parameters (e.g. LoRA's base) is split over the model shards:
    then the devices share that work even when the trained parameters split nothing."""
    frozen = layout.state_shardings.frozen_params
    if frozen is None:
        return False
    return splits_over_model_shards([s.spec for s in jax.tree_util.tree_leaves(frozen)])
