"""The layout a Trainer runs in: one frozen value, built in one place.

A :class:`Layout` is everything a run executes that depends on how the model is laid out: the
mesh, the sharding plan, the shardings of the training state and of the batches, and the jitted
train and eval steps (with the loss rewrite the candidate applies). The Trainer holds one and
swaps it in one assignment; nothing else keeps a piece of it.

A :class:`Candidate` is one setting of the choices left to redcoast: the number of model shards
(with ``n_model_shards='auto'``), FSDP on, off or by cost (fsdp_cost.py: decided from the traced
plan, without compiling), sibling-matmul fusion on or off (which also keeps K/V heads by groups of
shards). :func:`choose_layout` traces each candidate's plan from the loss; where several remain
(several numbers of model shards, or options given as lists), it compiles the distinct ones for
the first batch and keeps the fastest that fits a device by the cost model of cost_model.py;
``layout.table`` lists what was compared.
"""

import dataclasses
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from ..data import global_batch_size
from ..errors import ConfigError
from ..sharding import ShardingPlan
from ..sharding.axes import DATA_AXIS, MODEL_AXIS
from ..sharding.context import laid_out_for
from ..sharding.dataflow import traced_placements
from ..sharding.device_bound import holds_device_bound
from ..sharding.grouped_axes import entries as spec_entries, parse as parse_grouped
from ..sharding.grouped_conv import guard_grouped_convs
from ..sharding.permuted import storage_loss_fn, stored_layout, traced_permuted_placements
from ..sharding.rewrite_plan import RewritePlan
from ..train_state import TrainState
from . import compiler_options
from .cost_model import choose, estimate, format_table, link_costs
from .flops import jaxpr_flops
from .fsdp_cost import agreed_by_all_processes, choose_fsdp, per_device_flops
from .steps import (cast_floating, make_batch_eval_step, make_eval_step, make_loss_and_grad,
                    make_train_step)


@dataclasses.dataclass(frozen=True, eq=False)
class Recipe:
    """What the user asked of the training step: the same in every layout."""
    loss_fn: Callable
    compute_dtype: Any
    accumulate_grad_batches: int = 1
    train_step_fn: Callable = None
    log_grad_norm: bool = False
    params_sharding_rules: Any = None


BY_COST = "by cost"  # Candidate.fsdp: the tensors worth splitting (fsdp_cost.py)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One setting of the layout choices. ``fsdp``: True (every tensor it can), False, or
    ``BY_COST`` (the tensors whose gathers the step can afford, fsdp_cost.py)."""
    n_model_shards: int
    fsdp: bool | str
    fuse_matmuls: bool

    @property
    def name(self):
        fsdp = self.fsdp if self.fsdp == BY_COST else ("on" if self.fsdp else "off")
        return (f"mp={self.n_model_shards}, fsdp={fsdp}, "
                f"fusion={'on' if self.fuse_matmuls else 'off'}")


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """The layout a Trainer runs in, and why it was chosen.

    ``final`` is False for the layout the parameters are first placed in (a plan from their
    shapes), until the first batch has traced the loss and chosen.
    """
    candidate: Candidate
    mesh: Any
    plan: ShardingPlan
    state_shardings: TrainState
    batch_sharding: NamedSharding        # an update's batch (micro-batches first when accumulating)
    eval_batch_sharding: NamedSharding   # an evaluation batch, and its padding mask
    replicated: NamedSharding
    train_step: Callable                 # jitted: (state, batch, rng) -> (state, metrics)
    eval_step: Callable                  # jitted: (state, batch, mask, rng) -> (sums, count, spread)
    batch_eval_step: Callable            # jitted: (state, batch, rng) -> (sums, count), whole batches
    remainder_eval_step: Callable        # the same for a last, smaller batch placed replicated
    source: str = "the parameters' shapes"
    final: bool = True
    estimate: Any = None                 # the chosen candidate's cost_model.Estimate, if compared
    reason: str = "the only candidate"
    table: str = ""
    considered: tuple = ()               # ((Candidate, Estimate), ...) compared for the choice
    stored: Any = None                   # permuted.StoredLayout: how the state is stored, and back
    rewrite: Any = None                  # the RewritePlan the step's loss is run with (fusion.py), if any
    grad_step: Callable = None           # jitted: (state, micro-batch, rng) -> (loss, metrics, grads)
    #                                      as the built-in train step computes them (None with the
    #                                      user's own train_step_fn); for layout_check.py

    @property
    def name(self):
        return self.candidate.name

    @property
    def description(self):
        """The mesh and the choices in one phrase, each said once: ``dp=4 x mp=2, fsdp=on,
        fusion=off``. FSDP splits over the data shards, so over one it splits nothing and is
        said so (``fsdp=off (one data shard)``) whatever was asked."""
        c = self.candidate
        fsdp = (c.fsdp if c.fsdp == BY_COST else "on" if c.fsdp else "off")
        if c.fsdp and self.n_data_shards == 1:
            fsdp = "off (one data shard)"
        return (f"dp={self.n_data_shards} x mp={self.n_model_shards}, fsdp={fsdp}, "
                f"fusion={'on' if c.fuse_matmuls else 'off'}")

    @property
    def n_model_shards(self):
        return self.mesh.shape[MODEL_AXIS]

    @property
    def n_data_shards(self):
        return self.mesh.shape[DATA_AXIS]

    @property
    def fsdp(self):
        return self.candidate.fsdp

    @property
    def fuse_matmuls(self):
        return self.candidate.fuse_matmuls

    def global_batch_size(self, per_device_batch_size):
        return global_batch_size(per_device_batch_size, self.mesh)

    def __str__(self):
        return f"{self.name}: {self.reason}" + (f"\n{self.table}" if self.table else "")


def placed_on(tree, mesh):
    """Whether every leaf of ``tree`` is a jax.Array laid out on ``mesh``."""
    leaves = jax.tree_util.tree_leaves(tree)
    return bool(leaves) and all(isinstance(x, jax.Array) and getattr(x.sharding, "mesh", None) == mesh
                                for x in leaves)


def frozen_shardings(frozen, mesh):
    """Where ``frozen_params`` live: where they are, if that is ``mesh``; else a plan from their
    shapes (split over model shards, not over 'dp': they have no optimizer state)."""
    if frozen is None:
        return None
    if placed_on(frozen, mesh):
        return jax.tree_util.tree_map(lambda x: x.sharding, frozen)
    return ShardingPlan(frozen, mesh).param_shardings()


def shape_plan(recipe, candidate, mesh, params):
    """The plan from the parameters' shapes alone (before any batch has been traced)."""
    return ShardingPlan(params, mesh, user_rules=recipe.params_sharding_rules,
                        fsdp=bool(candidate.fsdp))


def trace_plan(recipe, candidate, mesh, state, abstract_batch, platform="cpu", budget_bytes=None):
    """(plan, where it came from): traced from the loss on one (abstract) micro-batch. FSDP
    ``BY_COST`` weighs each tensor's gather against the step's time on ``platform`` and the
    training state against a device's ``budget_bytes`` (fsdp_cost.py)."""
    def traced_loss(params, batch):
        return recipe.loss_fn(jax.random.PRNGKey(0), state,
                              cast_floating(params, recipe.compute_dtype), batch, True)

    # the loss as the step traces it (a GPU's cuDNN attention in it): its FLOPs, and whether it
    # holds an operation JAX lowers with the devices in hand
    step_jaxpr = jax.make_jaxpr(traced_loss)(state.params, abstract_batch)
    # K/V heads kept by groups of shards pay only with the K/V projection rewritten (the
    # built-in step's fusion): as written, XLA gathers their gradient repeated per query head
    # (gqa on 4 shards 1.375x Megatron's bytes, 1.125x replicated). They are placed on a second
    # view of the mesh, which JAX refuses in a program holding cuDNN's attention or a host
    # callback ("mesh should be the same across the entire program": device_bound.py).
    device_bound = holds_device_bound(step_jaxpr)
    grouped = candidate.fuse_matmuls and recipe.train_step_fn is None and not device_bound
    permutations = {}
    options = dict(n_model_shards=candidate.n_model_shards, group_kv_heads=grouped,
                   link_costs=link_costs(mesh))
    if recipe.train_step_fn is None:  # the built-in step runs the loss on fused projections stored permuted
        placements, source, permutations = traced_permuted_placements(
            traced_loss, state.params, abstract_batch, **options)
    else:
        placements, source = traced_placements(traced_loss, state.params, abstract_batch, **options)
    keep, note = frozenset(), ""
    if candidate.fsdp == BY_COST:
        unsplit = ShardingPlan(state.params, mesh, user_rules=recipe.params_sharding_rules,
                               base_placements=placements, permutations=permutations)
        flops = per_device_flops(jaxpr_flops(step_jaxpr), mesh.size)
        choice = agreed_by_all_processes(
            choose_fsdp(unsplit.before_fsdp, dict(mesh.shape), platform, flops,
                        len(mesh.local_devices), _state_bytes_per_param_byte(state), budget_bytes),
            [pl.path for pl in unsplit.before_fsdp])
        keep, note = choice.keep, choice.note
    plan = ShardingPlan(state.params, mesh, user_rules=recipe.params_sharding_rules,
                        base_placements=placements, fsdp=bool(candidate.fsdp),
                        permutations=permutations, fsdp_keep=keep, fsdp_note=note)
    if device_bound:
        _refuse_grouped_rules(plan)
    return plan, source


def _refuse_grouped_rules(plan):
    """A ConfigError where the user's rules place a parameter over groups of the model shards
    in a step JAX lowers only with every sharding on one mesh (device_bound.py)."""
    for pl in plan.compute_placements:
        if any(parse_grouped(name)[1] for name in spec_entries(pl.spec)):
            raise ConfigError(
                f"params_sharding_rules place {'/'.join(map(str, pl.path))} as {pl.spec}: over "
                "groups of the model shards, which lie on a second view of the mesh, and this "
                "step holds an operation JAX lowers only with every sharding on one mesh "
                "(cuDNN's attention, a custom_partitioning rule or a host callback such as "
                "jax.pure_callback: 'mesh should be the same across the entire program'). Fix: "
                "'mp' or None on that axis in the rule (redcoast itself keeps K/V heads "
                "replicated in such a step).")


def _state_bytes_per_param_byte(state):
    """What one byte of trained parameters costs a device: itself, its gradient and its share of
    the optimizer state."""
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize  # noqa: E731
                              for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype"))
    params = nbytes(state.params)
    return 2.0 + nbytes(state.opt_state) / params if params else 3.0


def build_layout(recipe, candidate, mesh, plan, state, source="the parameters' shapes", final=True):
    """The :class:`Layout` of ``candidate`` on ``mesh`` with ``plan``, for ``state``'s structure.
    Its steps are jitted, not compiled: they compile at their first call (or lowering)."""
    replicated = NamedSharding(mesh, P())
    state_shardings = TrainState(
        step=replicated, params=plan.param_shardings(),
        opt_state=plan.opt_state_shardings(state.opt_state), nonfinite_step=replicated,
        apply_fn=state.apply_fn, tx=state.tx,
        frozen_params=frozen_shardings(state.frozen_params, mesh))
    n = candidate.n_model_shards
    # the loss is traced knowing the number of model shards (sharding/context.py), and takes
    # the parameters as stored (fused projections permuted, sharding/permuted.py)
    loss_fn = laid_out_for(storage_loss_fn(recipe.loss_fn, plan.permutations), n, mesh=mesh)
    rewrite = (RewritePlan.from_sharding_plan(plan)
               if candidate.fuse_matmuls and recipe.train_step_fn is None else None)
    rows = NamedSharding(mesh, P(DATA_AXIS))
    grad_step = None
    # the grouped-convolution guard splits channels as the plan does, fused or not, and the
    # matmuls of weights kept whole are split by batch (or positions) in training and
    # evaluation alike
    guard_plan = RewritePlan.from_sharding_plan(plan)
    if recipe.train_step_fn is None:
        step_fn = make_train_step(
            loss_fn, recipe.compute_dtype, recipe.accumulate_grad_batches,
            grad_shardings=state_shardings.params, rewrite_plan=rewrite,
            compute_shardings=plan.compute_shardings(), log_grad_norm=recipe.log_grad_norm,
            mesh=mesh, guard_plan=guard_plan)
        loss_and_grad = make_loss_and_grad(loss_fn, recipe.compute_dtype, rewrite,
                                           plan.compute_shardings(), mesh, guard_plan)
        grad_step = jax.jit(lambda state, batch, rng: loss_and_grad(state, state.params, batch, rng),
                            in_shardings=(state_shardings, rows, replicated),
                            out_shardings=(replicated, replicated, state_shardings.params),
                            compiler_options=compiler_options.for_mesh(mesh, recipe.compute_dtype))
    else:  # the user's own step differentiates itself: its grouped convolutions (forward and
        # backward) are guarded as they come (sharding/grouped_conv.py)
        step_fn = guard_grouped_convs(_returning_state_and_metrics(recipe.train_step_fn), mesh)
    batch_sharding = rows if recipe.accumulate_grad_batches == 1 else NamedSharding(mesh, P(None, DATA_AXIS))
    # remat honoured on XLA:CPU too (compiler_options.py)
    train_step = jax.jit(step_fn, in_shardings=(state_shardings, batch_sharding, replicated),
                         out_shardings=(state_shardings, replicated), donate_argnums=(0,),
                         compiler_options=compiler_options.for_mesh(mesh, recipe.compute_dtype))
    eval_step = jax.jit(make_eval_step(loss_fn, recipe.compute_dtype, plan.compute_shardings(),
                                       mesh, guard_plan),
                        in_shardings=(state_shardings, rows, rows, replicated),
                        out_shardings=replicated)
    by_batch = make_batch_eval_step(loss_fn, recipe.compute_dtype, plan.compute_shardings(),
                                    mesh, guard_plan)
    batch_eval_steps = tuple(jax.jit(by_batch, in_shardings=(state_shardings, placed, replicated),
                                     out_shardings=replicated) for placed in (rows, replicated))
    return Layout(candidate, mesh, plan, state_shardings, batch_sharding, rows, replicated,
                  train_step, eval_step, *batch_eval_steps, source=source, final=final,
                  stored=stored_layout(plan.permutations, state_shardings), rewrite=rewrite,
                  grad_step=grad_step)


def _returning_state_and_metrics(train_step_fn):
    """The user's ``train_step_fn``, refused at its first trace unless it returns ``(new_state,
    metrics)`` with the new state shaped as the state it was given."""
    def step(state, batch, rng):
        out = train_step_fn(state, batch, rng)
        given = jax.tree_util.tree_structure(state)
        if not (isinstance(out, tuple) and len(out) == 2
                and jax.tree_util.tree_structure(out[0]) == given):
            what = (f"a {type(out).__name__}" if not isinstance(out, tuple) else
                    f"a tuple of {len(out)}" if len(out) != 2 else
                    f"(x, metrics) with x a {type(out[0]).__name__} not shaped as the state")
            if jax.tree_util.tree_structure(out) == given:
                what = "the new state alone"
            raise ConfigError(
                f"train_step_fn returned {what}; it must return (new_state, metrics), the new "
                "state a TrainState like the one it was given and metrics a dict of scalars. "
                "Fix: end it with `return state.apply_gradients(grads=grads), {'loss': loss}`.")
        return out
    return step


def lower_train_step(layout, state, abstract_micro_batch, accumulate_grad_batches, rng):
    """``layout``'s training step lowered for ``state``'s and ``rng``'s shapes and one update's
    batch."""
    k = accumulate_grad_batches
    # placed as the real batches will be, so that the call reuses this compilation
    batch = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape if k == 1 else (k, *x.shape), x.dtype,
                                       sharding=layout.batch_sharding), abstract_micro_batch)
    abstract_state = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, layout.state_shardings)
    rng = jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=layout.replicated)
    return layout.train_step.lower(abstract_state, batch, rng)


def candidates_at(n_model_shards, n_data_shards, fsdp_options, fuse_options):
    """The candidates that can differ on a mesh of this shape: FSDP does nothing with one data
    shard, fusion nothing with one model shard (nor with the user's own train_step_fn, which
    the caller says by giving one fuse option)."""
    fsdp = fsdp_options if n_data_shards > 1 else fsdp_options[:1]
    fuse = fuse_options if n_model_shards > 1 else [False]
    return [Candidate(n_model_shards, f, m) for f in fsdp for m in fuse]


def choose_layout(recipe, state, rng, shard_counts, fsdp_options, fuse_options, batch_for,
                  make_mesh, budget_bytes, platform, memory=None):
    """The final :class:`Layout` for ``state``: among the candidates (``shard_counts`` x
    ``fsdp_options`` x ``fuse_options``) the fastest that fits ``budget_bytes`` per device.

    ``batch_for(mesh)`` gives the first micro-batch (abstract) on a mesh; ``make_mesh(n)`` the
    mesh with n model shards. One candidate (the Trainer's defaults: FSDP by cost, fusion on):
    built, not compiled. Several numbers of model shards (``'auto'``): each is first measured
    in its leanest setting (the last of the options), from the fewest shards up, stopping once
    a count that fits costs more per example than the one before; a count over which the plan
    splits nothing is not measured (its devices would repeat the same work); the other settings
    are compared at the best count only. A few compilations at the first batch in all. With a ``memory``
    (layout_memory.LayoutMemory), a choice it remembers for these parameters and this first
    batch (on the mesh of the fewest shards) is taken without compiling any other, where it is
    among those allowed; a choice made by comparing is remembered there.
    """
    traced = {}  # Candidate -> (plan, source, abstract batch, mesh)
    batches = {}  # n_model_shards -> (mesh, the first batch on it): collated once per mesh

    def trace(c):
        if c not in traced:
            if c.n_model_shards not in batches:
                mesh = make_mesh(c.n_model_shards)
                batches[c.n_model_shards] = mesh, batch_for(mesh)
            mesh, abstract = batches[c.n_model_shards]
            plan, source = trace_plan(recipe, c, mesh, state, abstract, platform, budget_bytes)
            traced[c] = (plan, source, abstract, mesh)
        return traced[c]

    def distinct(candidates):
        out, seen = [], set()
        for c in candidates:
            plan = trace(c)[0]
            key = (c.n_model_shards, tuple(pl.spec for pl in plan.placements),
                   tuple(pl.spec for pl in plan.compute_placements), c.fuse_matmuls)
            if key not in seen:
                seen.add(key)
                out.append(c)
        return out

    def shape_of(n):  # data shards with n model shards
        return make_mesh(n).shape[DATA_AXIS]

    remembered = where = None
    if memory is not None:  # the first batch, collated once: tracing takes it from here
        n = min(shard_counts)
        if n not in batches:
            mesh = make_mesh(n)
            batches[n] = mesh, batch_for(mesh)
        first_batch = batches[n][1]
        remembered, where = memory.recall(state.params, first_batch, Candidate) or (None, None)
    if remembered is not None and remembered in candidates_at(
            remembered.n_model_shards, shape_of(remembered.n_model_shards), fsdp_options,
            fuse_options) and remembered.n_model_shards in shard_counts:
        plan, source, _, mesh = trace(remembered)
        if memory.path is not None and where != memory.path:  # the workdir keeps its own record
            memory.remember(state.params, first_batch, remembered, f"remembered from {where}")
        return dataclasses.replace(
            build_layout(recipe, remembered, mesh, plan, state, source),
            reason=f"remembered from the run that chose it in {where} (the same model, "
                   "batch, devices and options); delete that file to compare the candidates again")

    if len(shard_counts) == 1:
        n = shard_counts[0]
        options = distinct(candidates_at(n, shape_of(n), fsdp_options, fuse_options))
        if len(options) == 1:
            c = options[0]
            plan, source, _, mesh = traced[c]
            return build_layout(recipe, c, mesh, plan, state, source)
    else:
        options = []
    measured, layouts = {}, {}

    def measure(c):
        if c not in measured:
            plan, source, abstract, mesh = trace(c)
            layout = build_layout(recipe, c, mesh, plan, state, source)
            compiled = lower_train_step(layout, state, abstract, recipe.accumulate_grad_batches,
                                        rng).compile()
            examples = jax.tree_util.tree_leaves(abstract)[0].shape[0] * recipe.accumulate_grad_batches
            measured[c] = estimate(compiled, mesh, platform, examples)
            layouts[c] = layout
        return measured[c]

    skipped = []  # shard counts the plan splits nothing over: not compared
    if len(shard_counts) > 1:
        best = last = None
        for n in sorted(shard_counts):
            lean = distinct(candidates_at(n, shape_of(n), fsdp_options, fuse_options))[-1]
            if not trace(lean)[0].splits_over_model_shards():
                skipped.append(n)  # its devices would repeat the same work
                continue
            e, last = measure(lean), lean
            if e.memory_bytes > budget_bytes:
                continue
            if best is not None and e.seconds_per_example >= measured[best].seconds_per_example:
                break
            best = lean
        if best is None:
            n = last.n_model_shards
            raise ConfigError(
                f"n_model_shards='auto': even split over {n} model shards the training step needs "
                f"{_bytes_text(measured[last].memory_bytes)} per device, over the budget of "
                f"{_bytes_text(budget_bytes)}. Fix: a smaller per_device_batch_size, "
                "accumulate_grad_batches, compute_dtype=jnp.bfloat16, rematerialisation in the "
                "model, or more devices.")
        options = distinct(candidates_at(best.n_model_shards, shape_of(best.n_model_shards),
                                         fsdp_options, fuse_options))
    for c in options:
        measure(c)
    compared = list(measured)
    estimates = [measured[c] for c in compared]
    i, why = choose(estimates, budget_bytes)
    chosen = compared[i]
    table = format_table(compared, estimates, i, budget_bytes)
    if memory is not None and len(compared) > 1:
        memory.remember(state.params, first_batch, chosen, why)
    if skipped:
        table += (f"\nmp={', '.join(map(str, skipped))}: not compared, the model has nothing to "
                  "split over that many model shards")
    return dataclasses.replace(
        layouts[chosen], estimate=estimates[i], reason=why, table=table,
        considered=tuple(zip(compared, estimates)))


def _bytes_text(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
