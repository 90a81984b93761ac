"""The training loop around one jitted, sharded step."""

import itertools
import math
from collections.abc import Mapping
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from . import validate
from .abstract import is_abstract, placed, shapes_of
from .launch import heartbeat
from .memory_check import StepMemory, require_fits
from .checkpoint import CheckpointStore, key_from_json, key_to_json
from .export import save_params
from .fingerprint import check_fingerprint, fingerprint
from .data import (BatchMaker, Stream, check_collated, epoch_order, examples_by_epoch, is_iterator,
                   is_sequence, padded_batches, prefetch, take)
from .errors import (ConfigError, DataError, EvaluationError, LayoutCheckError, LossError,
                     NonFiniteLossError)
from .host import to_host
from .layout import (Candidate, Recipe, build_layout, choose_layout, frozen_shardings,
                     lower_train_step, placed_on, shape_plan)
from .layout_check import check_layout
from .predictor import Predictor
from .preemption import PreemptionGuard
from .sharding.dataflow import FALLBACK
from .throughput import StepCost, compiled_flops, peak_flops, tokens_per_example
from .train_state import TrainState
from .layout_memory import LayoutMemory
from .workdir import WorkdirLock, agree, is_url, move_aside


class Trainer:
    """Trains ``params`` with ``loss_fn`` on the deployer's mesh.

    ``loss_fn(rng, state, params, batch, is_training)`` returns a scalar loss or
    ``(loss, {name: scalar})``; ``params`` arrive in ``compute_dtype``. Parameter placement comes
    from ``params_sharding_rules`` (the paper's format) where given, automatic rules elsewhere.
    ``train_step_fn(state, batch, rng) -> (state, metrics)`` replaces the built-in step.
    ``fsdp=True`` also splits large parameters and their optimizer state over the data-parallel
    axis (ZeRO-3), so each device holds about 1/device_count of them; ``fsdp=False`` keeps one
    copy per data shard. ``fuse_matmuls=True`` runs sibling matmuls (Q/K/V, gate/up) of a split
    model as one, so the step moves Megatron-LM's bytes between model shards. Left None (the
    default), each is decided at the first batch from the compiled steps of the candidate layouts
    (redcoast/layout.py): the fastest by XLA's cost and memory analyses that fits a device;
    ``trainer.layout`` says which and why.
    ``log_grad_norm=True`` logs the global norm of each update's gradient as ``train_grad_norm``
    (off by default: one more reduction and all-reduce in the step, +12% on a small CPU run).
    Logged throughput: ``train_step_time_s``, ``train_examples_per_s``, ``train_tokens_per_s``
    (where the batch has integer ``[batch, sequence]`` arrays) and ``train_mfu`` (XLA's FLOPs of
    the compiled step over the device's peak; null (None) where the peak is unknown, e.g. on CPUs).
    ``frozen_params``: parameters the step reads but does not train (a LoRA base, see
    redcoast/lora.py): placed on the mesh (as given where they already are, else by a plan from
    their shapes), passed to each step as an input, never differentiated, given no optimizer
    state and not checkpointed; ``loss_fn`` reads them as ``state.frozen_params``.
    ``eval_by``: how evaluation applies ``loss_fn``. ``'example'``: to one example at a time, so
    the result is the exact mean over examples whatever the batch size (the paper's; padded
    rows count for nothing). ``'batch'``: to whole batches, weighted by their rows, for a loss
    defined over the batch (a contrastive loss is 0 on one example); the last, smaller batch is
    evaluated as it is. None (the default): 'example', unless the first evaluation batch gives
    every example alone the same loss and the whole batch another (then 'batch', said in the log).
    """

    def __init__(self, deployer, collate_fn, apply_fn, loss_fn, params, optimizer,
                 lr_schedule_fn=None, accumulate_grad_batches=1, params_sharding_rules=None,
                 compute_dtype=jnp.float32, train_step_fn=None, fsdp=None, fuse_matmuls=None,
                 log_grad_norm=False, frozen_params=None, eval_by=None):
        validate.trainer_args(collate_fn, loss_fn, optimizer, train_step_fn, params, frozen_params)
        if eval_by not in (None, "example", "batch"):
            raise ConfigError(f"eval_by={eval_by!r}; it must be 'example' (loss_fn applied to "
                              "one example at a time, the exact mean over examples), 'batch' "
                              "(to whole batches: a loss defined over the batch, such as a "
                              "contrastive one) or None (decided at the first evaluation).")
        self._eval_by = eval_by
        self._layout_checked = False  # by check_layout, or by train/fit(check_layout=True)
        if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
            raise ConfigError(f"accumulate_grad_batches={accumulate_grad_batches!r}; it must be a "
                              "positive integer.")
        self.deployer = deployer
        self.collate_fn = collate_fn
        self.loss_fn = loss_fn
        self.lr_schedule_fn = lr_schedule_fn
        self.accumulate_grad_batches = accumulate_grad_batches
        self.compute_dtype = compute_dtype
        self.params_sharding_rules = params_sharding_rules
        self.train_step_fn = train_step_fn
        self.recipe = Recipe(loss_fn, compute_dtype, accumulate_grad_batches, train_step_fn,
                             bool(log_grad_norm), params_sharding_rules)
        # None: chosen at the first batch (choose_layout); until then FSDP on, fusion off
        self._options = {"fsdp": [False, True] if fsdp is None else [bool(fsdp)],
                         "fuse_matmuls": ([False, True] if fuse_matmuls is None and train_step_fn is None
                                          else [bool(fuse_matmuls)])}
        # A first layout from the shapes alone, so the parameters are placed (and trainer.params
        # usable) at once; the first batch replaces it by one traced from the loss's data flow.
        mesh = deployer.mesh
        first = Candidate(deployer.n_model_shards, fsdp is not False, bool(fuse_matmuls))
        plan = shape_plan(self.recipe, first, mesh, params)
        param_shardings = plan.param_shardings()
        # parameters as jax.ShapeDtypeStructs: plan and compile, nothing allocated (abstract.py)
        self.is_abstract = is_abstract(params)
        if self.is_abstract:
            params = placed(params, param_shardings)
        else:  # The step donates its state, which must never delete the caller's arrays, and
            # device_put may reuse their buffers: a compiled copy owns fresh ones.
            params = jax.jit(_copy_tree, out_shardings=param_shardings)(
                jax.device_put(params, param_shardings))
        opt_shardings = plan.opt_state_shardings(jax.eval_shape(optimizer.init, params))
        opt_state = (shapes_of(optimizer.init, params, opt_shardings) if self.is_abstract else
                     jax.jit(optimizer.init, out_shardings=opt_shardings)(params))
        if frozen_params is not None and (self.is_abstract or is_abstract(frozen_params)):
            frozen_params = placed(frozen_params, frozen_shardings(frozen_params, mesh))
        elif frozen_params is not None:  # a copy the step may donate, as for params
            shardings = frozen_shardings(frozen_params, mesh)
            if deployer.n_model_shards > 1 and not placed_on(frozen_params, mesh):
                deployer.log_warning(
                    "frozen_params are placed by a plan from their shapes alone. For the plan "
                    "traced from the model's data flow, pass them placed: from_pretrained(..., "
                    "deployer) does it, or jax.device_put(tree, deployer.get_sharding_plan(tree, "
                    "traced_fn=apply_fn, example_args=...).param_shardings()).")
            frozen_params = jax.jit(_copy_tree, out_shardings=shardings)(
                jax.device_put(frozen_params, shardings))
        replicated = NamedSharding(mesh, P())
        keys = deployer.gen_rng(), deployer.gen_rng()  # drawn alike either way: same streams
        if self.is_abstract:  # counters and keys as shapes too: the devices may be compile-only
            self._keys_to_place = keys  # by set_params
            scalar = lambda v: jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)  # noqa: E731
            keys = placed(keys, (replicated, replicated))
        else:
            scalar = lambda v: jax.device_put(jnp.asarray(v, jnp.int32), replicated)  # noqa: E731
            keys = jax.device_put(keys, replicated)
        self._state = TrainState(step=scalar(0), params=params, opt_state=opt_state,
                                 nonfinite_step=scalar(-1), apply_fn=apply_fn, tx=optimizer,
                                 frozen_params=frozen_params)
        self._host_step = 0
        self._train_rng, self._eval_rng = keys
        self._best = {}
        self._first_epoch = 0  # fit's first epoch when no checkpoint is resumed (redco's last_ckpt_info)
        self.layout = build_layout(self.recipe, first, mesh, plan, self._state, final=False)
        self._step_costs = {}  # batch shapes -> StepCost, for the current layout's train step

    @property
    def plan(self):
        """The sharding plan of the current layout (``trainer.layout.plan``)."""
        return self.layout.plan

    @property
    def fsdp(self):
        return self.layout.fsdp

    @property
    def fuse_matmuls(self):
        return self.layout.fuse_matmuls

    @property
    def mesh(self):
        """The mesh the trainer runs on (the deployer's, or the one 'auto' chose)."""
        return self.layout.mesh

    def global_batch_size(self, per_device_batch_size):
        return self.layout.global_batch_size(per_device_batch_size)

    def _settle_layout(self, batch_for):
        """Once, before the first step: choose the layout from the loss traced on the first
        batch (``batch_for(mesh)``: a first micro-batch on ``mesh``), move the state to it and
        say what was chosen and why."""
        if self.layout.final:
            return
        deployer = self.deployer
        shard_counts = (deployer.model_shard_candidates() if deployer.n_model_shards_requested == "auto"
                        else [deployer.n_model_shards])
        memory = self._layout_memory(shard_counts)
        started = time.perf_counter()
        layout = choose_layout(
            self.recipe, self._state, self._train_rng, shard_counts, self._options["fsdp"],
            self._options["fuse_matmuls"], lambda mesh: _abstract(batch_for(mesh)),
            deployer.mesh_for, deployer.device_memory_budget(), deployer.platform, memory)
        if len(layout.considered) > 1:
            deployer.log_info(
                f"choosing the layout compiled {len(layout.considered)} candidate steps in "
                f"{time.perf_counter() - started:.1f} s"
                + (f"; the choice is remembered in {memory.path} for the next run" if memory else
                   "; a workdir would remember it for the next run")
                + f" (fsdp={layout.candidate.fsdp}, fuse_matmuls={layout.candidate.fuse_matmuls} "
                "in the Trainer skip the comparison).")
        self._adopt(layout)
        if layout.source.startswith(FALLBACK):  # said always, not only in verbose runs
            deployer.log_warning(f"sharding plan from {layout.source}")
        if len(shard_counts) == 1 and layout.plan.nothing_to_split():  # said always: n x the work
            deployer.log_warning(layout.plan.nothing_to_split() + ".")
        if len(shard_counts) > 1:  # said always: the run's mesh is not the one the deployer began with
            deployer.log_info(f"n_model_shards='auto' chose {layout.n_model_shards} (mesh dp="
                              f"{layout.n_data_shards} x mp={layout.n_model_shards}): {layout.reason}.")
        if deployer.verbose:
            if layout.table:
                deployer.log_info(f"{layout.name}: {layout.reason}.\n{layout.table}",
                                  title="Layout (candidates compiled for the first batch)")
            deployer.log_info(layout.plan.table(), title=f"Sharding plan (from {layout.source})")
            deployer.log_info(layout.plan.rules_source(), title="As params_sharding_rules:")

    def _layout_memory(self, shard_counts):
        """Where this run's layout choice is remembered (the workdir's layout.json), with what
        it depends on besides the parameters and the batch; None without a local workdir."""
        workdir = self.deployer.workdir
        if workdir is None or is_url(workdir):  # remote workdirs: chosen each run
            return None
        options = {"shard_counts": list(shard_counts), "fsdp": list(self._options["fsdp"]),
                   "fuse_matmuls": list(self._options["fuse_matmuls"]),
                   "compute_dtype": str(jnp.dtype(self.compute_dtype)),
                   "accumulate": self.accumulate_grad_batches,
                   "budget": self.deployer.device_memory_budget(),
                   "own_train_step": self.recipe.train_step_fn is not None}
        return LayoutMemory.in_workdir(workdir, options)

    def _adopt(self, layout):
        """Run in ``layout`` from now on: the state and random keys move to it (donated: a model
        may fill the devices). Between layouts the state is in the user's layout."""
        old = self.layout
        self.layout = layout
        self._step_costs = {}
        if self.is_abstract:  # the same conversions, on shapes
            state = jax.eval_shape(old.stored.state_to_user, self._state)
            self._state = shapes_of(layout.stored.state_to_storage,
                                    placed(state, layout.state_shardings), layout.state_shardings)
            self._train_rng, self._eval_rng = placed((self._train_rng, self._eval_rng),
                                                     (layout.replicated, layout.replicated))
        else:
            state = old.stored.state_to_user(self._state)
            self._state = layout.stored.state_to_storage(
                jax.device_put(state, layout.state_shardings, donate=True))
            self._train_rng = jax.device_put(self._train_rng, layout.replicated)
            self._eval_rng = jax.device_put(self._eval_rng, layout.replicated)

    def _first_batch(self, examples, order, per_device_batch_size, mesh):
        """One micro-batch on ``mesh``, for tracing and measuring the step (from a
        :class:`Stream`, its next examples, read ahead and kept for training)."""
        global_batch = per_device_batch_size * mesh.shape["dp"]
        if isinstance(examples, Stream):
            examples = examples.peek(global_batch)
            if len(examples) < global_batch:
                raise ConfigError(
                    f"train_examples ended after {len(examples)} examples, fewer than one batch of "
                    f"{global_batch} (per_device_batch_size={per_device_batch_size} x "
                    f"{mesh.shape['dp']} data shards). Fix: use a smaller batch size.")
            order = np.arange(global_batch)
        else:  # enough for one update on this mesh
            _updates_per_epoch(len(order), per_device_batch_size, mesh.shape["dp"],
                               self.accumulate_grad_batches)
        return BatchMaker(mesh, self.collate_fn, global_batch).make(examples, order[:global_batch])

    @property
    def state(self):
        """The training state, in the user's layout (fused projections the layout stores
        permuted are presented as given)."""
        if self.is_abstract:
            return placed(jax.eval_shape(self.layout.stored.state_to_user, self._state),
                          self.layout.state_shardings)
        return self.layout.stored.state_to_user(self._state)

    @property
    def params(self):
        """The parameters, in the user's layout (as :attr:`state`); shapes alone when the
        Trainer is abstract."""
        if self.is_abstract:
            return self.state.params
        return self.layout.stored.params_to_user(self._state.params)

    @property
    def frozen_params(self):
        """The untrained parameters given as ``frozen_params`` (None if none), as placed."""
        return self._state.frozen_params

    @property
    def step(self):
        """Optimizer updates applied so far."""
        return self._host_step

    def set_params(self, params, reset_opt_state=True):
        """Continue from ``params`` (the structure and shapes of ``trainer.params``, e.g. a FedAvg
        round's average) with the steps already compiled; the optimizer state starts afresh
        unless ``reset_opt_state=False``. The caller's arrays are copied, never donated."""
        current = jax.tree_util.tree_map(lambda x: (x.shape, jnp.dtype(x.dtype)), self._state.params)
        given = jax.tree_util.tree_map(lambda x: (np.shape(x), jnp.dtype(x.dtype)), params)
        if given != current:
            raise ConfigError("set_params was given parameters of another structure, shape or "
                              "dtype than trainer.params. Fix: pass a tree shaped like "
                              "trainer.params (build a new Trainer for another model).")
        here = set(jax.devices())
        if self.is_abstract and not all(d in here for d in self.layout.mesh.devices.flat):
            raise ConfigError(
                f"set_params cannot make this Trainer concrete: its devices "
                f"({self.deployer.platform}, e.g. {self.layout.mesh.devices.flat[0]}) are a "
                "compile-only target, not devices of this machine. Fix: plan and compile here; "
                "build the Trainer for training on the machine that has those devices.")
        if self.is_abstract and self._state.frozen_params is not None \
                and is_abstract(self._state.frozen_params):
            raise ConfigError("set_params cannot make this Trainer concrete: its frozen_params "
                              "are abstract (jax.ShapeDtypeStruct) too. Fix: build the Trainer "
                              "with the real frozen_params.")
        params = self.layout.stored.params_to_storage(
            jax.jit(_copy_tree, out_shardings=self.layout.state_shardings.params)(
                jax.device_put(params, self.layout.state_shardings.params)))  # from any mesh
        state = self._state.replace(params=params)
        if reset_opt_state or self.is_abstract:  # an abstract optimizer state has nothing to keep
            state = state.replace(opt_state=jax.jit(
                state.tx.init, out_shardings=self.layout.state_shardings.opt_state)(params))
        if self.is_abstract:  # the counters and keys a Trainer built from these params starts with
            replicated = self.layout.replicated
            state = state.replace(step=jax.device_put(jnp.int32(0), replicated),
                                  nonfinite_step=jax.device_put(jnp.int32(-1), replicated))
            self._train_rng, self._eval_rng = jax.device_put(self._keys_to_place, replicated)
        self._state = state
        self.is_abstract = False

    def _require_concrete(self, doing):
        """Refuse ``doing`` on a Trainer built from abstract parameters."""
        if self.is_abstract:
            raise ConfigError(
                f"this Trainer was built from abstract parameters (jax.ShapeDtypeStruct): it "
                f"plans and compiles (trainer.compile_train_step(batch)) but cannot {doing}. Fix: "
                "trainer.set_params(real parameters of the same shapes) first.")

    def get_default_predictor(self, pred_fn, output_fn=None):
        """A :class:`Predictor` sharing this trainer's collate_fn and parameter placement."""
        return Predictor(self.deployer, self.collate_fn, pred_fn, output_fn=output_fn)

    def updates_per_epoch(self, n_examples, per_device_batch_size):
        """Optimizer updates in one epoch (the last incomplete batch is dropped)."""
        return _updates_per_epoch(n_examples, per_device_batch_size, self.layout.n_data_shards,
                                  self.accumulate_grad_batches)

    def compile_train_step(self, example_batch):
        """The compiled training step for global batches shaped like ``example_batch`` (a dict
        as ``collate_fn`` returns, with the micro-batch axis first when accumulating): read its
        ``memory_analysis()`` or ``cost_analysis()``, or its collectives with
        ``redcoast.comms.collective_report``. Fixes the sharding plan, as the first batch would."""
        micro = jax.tree_util.tree_map(lambda x: x[0] if self.accumulate_grad_batches > 1 else x,
                                       _abstract(example_batch))
        given = self.layout.n_data_shards  # the mesh the batch was made for

        def batch_for(mesh):  # another mesh ('auto' trying shard counts): the same rows per data shard
            return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(
                (x.shape[0] * mesh.shape["dp"] // given, *x.shape[1:]), x.dtype), micro)

        self._settle_layout(batch_for)
        return lower_train_step(self.layout, self._state, batch_for(self.mesh),
                                self.accumulate_grad_batches, self._train_rng).compile()

    def train(self, examples, per_device_batch_size, desc=None, shuffle=True, epoch=0,
              log_every_n_steps=10, start_position=0, after_step=None, start_example=None,
              check_layout=False, start_fingerprint=None):
        """One pass over ``examples`` from update ``start_position`` of the epoch on: a sequence
        is shuffled from the seed and ``epoch``; any other iterable (a generator, a
        ``datasets.IterableDataset``, a :class:`~redcoast.data.Stream`) is read in order until it
        ends. ``start_example``: how many examples of the epoch (in its order) were trained before
        (default ``start_position`` updates' worth at this batch size; an interrupted run may
        have trained them in updates of another size): training goes on at the next one, a
        stream's first ones skipped without collating. The last incomplete update is not trained
        on (a stream's count of them is in its ``leftover``).

        ``after_step(position)`` runs after each update (``position`` updates of this epoch
        done, counting from ``start_position``); if it returns True the epoch stops there.
        Returns the position reached.
        ``check_layout=True``: the layout is checked against one device on the first batch
        before the first update this trainer runs (:meth:`check_layout`).
        ``start_fingerprint``: a stream's skipped examples must have it (a checkpoint's
        ``stream_fingerprint``), else a :class:`DataError`.
        """
        validate.positive_int("log_every_n_steps", log_every_n_steps)
        self._require_concrete("train")
        k = self.accumulate_grad_batches
        stream = None if is_sequence(examples) else (
            examples if isinstance(examples, Stream) else Stream(examples))
        order = None if stream is not None else epoch_order(len(examples), self.deployer.jax_seed,
                                                            epoch, shuffle)
        # a stream's first examples are read ahead and kept (the skip below may consume them)
        def first_batch(mesh):
            return self._first_batch(examples if stream is None else stream, order,
                                     per_device_batch_size, mesh)
        self._settle_layout(first_batch)
        if check_layout and not self._layout_checked:
            self._check_layout_on(first_batch(self.mesh), rtol=None)
        global_batch = self.global_batch_size(per_device_batch_size)
        per_update = global_batch * k
        skip = start_position * per_update if start_example is None else int(start_example)
        if stream is None:
            self.updates_per_epoch(len(examples), per_device_batch_size)  # one update fits
            n_steps = start_position + _updates_after(len(examples), skip, per_update, epoch)
        else:
            examples, order, n_steps = stream, None, None  # its length is unknown until it ends
            skipped = stream.skip(skip)
            if skipped == skip and start_fingerprint is not None \
                    and stream.fingerprint(skip) != start_fingerprint:
                raise DataError(
                    f"train_examples gives other examples than the interrupted run read: the "
                    f"first {skip} examples of epoch {epoch + 1}, which the checkpoint says were "
                    "trained on, are not those (their fingerprint differs), so skipping them "
                    "would leave examples untrained and train others twice. Fix: give the same "
                    "examples in the same order on resume (a function of the epoch or a "
                    "re-iterable that starts the epoch afresh), or resume=False to start afresh.")
            if skipped < skip:
                raise DataError(
                    f"train_examples ended after {skipped} examples of epoch {epoch + 1}, but "
                    f"{skip} of them were trained on before the resumed "
                    "checkpoint: it is not the stream the interrupted run read. Fix: give the "
                    "same examples in the same order on resume (a function of the epoch or a "
                    "re-iterable that starts the epoch afresh), or resume=False.")
        maker = BatchMaker(self.mesh, self.collate_fn, global_batch, micro_batches=k)
        if stream is None:
            starts = skip + per_update * np.arange(n_steps - start_position)
            batches = prefetch(maker.make(examples, order[s:s + per_update]) for s in starts)
        else:  # every process reads the whole stream and collates only its own rows
            rows = np.arange(per_update)
            batches = prefetch(maker.make(group, rows) for group in stream.updates(per_update))
        bar = tqdm(total=n_steps, initial=start_position, desc=desc or "train", dynamic_ncols=True,
                   disable=not (self.deployer.verbose and jax.process_index() == 0))
        pending, timed, since = [], 0, time.perf_counter()
        position = start_position
        try:
            for batch in batches:
                if position == start_position:
                    self._require_step_fits(batch)
                self._state, metrics = self.layout.train_step(self._state, batch, self._train_rng)
                heartbeat()  # redcoast launch's watchdog: this process makes progress
                self._host_step += 1
                position += 1
                pending.append(metrics)
                if position == start_position + 1:  # the first call compiles: time from its end
                    since = time.perf_counter()
                else:
                    timed += 1
                if len(pending) == log_every_n_steps or position == n_steps:
                    self._log_train(pending, bar, batch, timed, since)
                    pending, timed, since = [], 0, time.perf_counter()
                bar.update(1)
                if after_step is not None and after_step(position):
                    break
            if pending:  # the end of a stream, or a stop before the logging interval
                self._log_train(pending, bar, batch, timed, since)
        finally:
            bar.close()
        if stream is not None and skip == 0 and position == 0:
            raise ConfigError(
                f"train_examples ended after {stream.leftover} examples in epoch {epoch + 1}, "
                f"fewer than one update of {per_update} (per_device_batch_size="
                f"{per_device_batch_size} x {self.layout.n_data_shards} data shards x "
                f"accumulate_grad_batches={k}). Fix: use a smaller batch size.")
        return position

    def _check_finite(self):
        """Raise if a loss was NaN or inf (one host sync): such a state is never saved."""
        bad_step = int(to_host(self._state.nonfinite_step))
        if bad_step >= 0:
            self._nonfinite(bad_step, "NaN or inf")

    def _nonfinite(self, bad_step, value):
        """Stop at the first non-finite loss: the step count goes back to the updates applied
        (those from ``bad_step`` on were not), and the error says so."""
        self._host_step = bad_step
        self._state = self._state.replace(
            step=jax.device_put(jnp.asarray(bad_step, jnp.int32), self.layout.replicated))
        raise NonFiniteLossError(_nonfinite_message(bad_step, value))

    def _log_train(self, pending, bar, batch, timed, since):
        """Pull the metrics of the last few steps (one host sync), check them, log them with
        the throughput of the ``timed`` steps run since ``since`` (timed after that sync, so
        the window holds their execution, not only their dispatch)."""
        history, bad_step = to_host((pending, self._state.nonfinite_step))
        elapsed = time.perf_counter() - since
        if bad_step >= 0:
            self._nonfinite(int(bad_step), _describe_nonfinite(history))
        means = {k: float(np.mean([m[k] for m in history])) for k in history[-1]}
        if self.lr_schedule_fn is not None:
            means["lr"] = float(self.lr_schedule_fn(self._host_step - 1))
        if timed and elapsed > 0:  # none when the window held only the compiling step
            means.update(self._step_cost(batch).rates(timed, elapsed))
        bar.set_postfix({k: f"{v:.4g}" for k, v in means.items() if v is not None},
                        refresh=False)
        self.deployer.log_metrics({f"train_{k}": v for k, v in means.items()}, self._host_step)

    def _require_step_fits(self, batch):
        """Before a run's first step on an accelerator (or with ``memory_budget_bytes``): the
        compiled step's peak against the device's memory, so that a step too big stops here
        with its memory explained (memory_check.py). The step's own call reuses this compile."""
        deployer = self.deployer
        if deployer.platform == "cpu" and not deployer.memory_budget_bytes:
            return  # simulated devices share the host's memory: no per-device limit to hold
        compiled = self.layout.train_step.lower(self._state, batch, self._train_rng).compile()
        source = ("Deployer(memory_budget_bytes=...)" if deployer.memory_budget_bytes else
                  f"the {deployer.platform} device's memory limit")
        require_fits(StepMemory.of(compiled, self._state), deployer.device_memory_budget(),
                     f"layout {self.layout.name}", source)

    def _step_cost(self, batch):
        """What one update of batches shaped like ``batch`` processes and costs: read once per
        compiled step (lowering and compiling again after the step ran is a cache hit)."""
        key = jax.tree_util.tree_structure(batch), tuple(
            (x.shape, x.dtype) for x in jax.tree_util.tree_leaves(batch))
        if key in self._step_costs:
            return self._step_costs[key]
        k = self.accumulate_grad_batches
        leaves = jax.tree_util.tree_leaves(batch)
        examples = leaves[0].shape[1 if k > 1 else 0] * k
        micro = batch if k == 1 else jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch)
        per_example = tokens_per_example(micro)
        device = self.layout.mesh.devices.flat[0]
        compiled = self.layout.train_step.lower(self._state, batch, self._train_rng).compile()
        cost = StepCost(examples=examples,
                        tokens=None if per_example is None else per_example * examples,
                        flops_per_device=compiled_flops(compiled),
                        peak_flops=peak_flops(device, self.compute_dtype))
        why_not = cost.mfu_unknown_reason(device, self.compute_dtype)
        if why_not and not self._step_costs:  # said once
            self.deployer.log_info(f"MFU: n/a ({why_not}).")
        self._step_costs[key] = cost
        return cost

    def _evaluate(self, examples, per_device_batch_size, desc=None):
        """Means over examples of the loss and metrics, every example counted exactly once:
        ``loss_fn`` applied to one example at a time, or to whole batches (``eval_by``)."""
        self._require_concrete("evaluate")
        def first_batch(mesh):
            global_batch = per_device_batch_size * mesh.shape["dp"]
            return BatchMaker(mesh, self.collate_fn, global_batch).make(
                examples, next(padded_batches(len(examples), global_batch))[0])

        self._settle_layout(first_batch)
        if self._eval_by == "batch":
            return self._evaluate_by_batch(examples, per_device_batch_size)
        global_batch = self.global_batch_size(per_device_batch_size)
        maker = BatchMaker(self.mesh, self.collate_fn, global_batch)
        batches = prefetch((maker.make(examples, idx), maker.padding_mask(n_real), idx, n_real)
                           for idx, n_real in padded_batches(len(examples), global_batch))
        totals, count = None, 0.0
        for batch, mask, idx, n_real in batches:
            sums, n, spread = self.layout.eval_step(self._state, batch, mask, self._eval_rng)
            heartbeat()
            if self._eval_by is None:  # the first evaluation: is the loss defined per example?
                self._eval_by = self._eval_mode(examples, idx, n_real, batch, sums, spread)
                if self._eval_by == "batch":
                    return self._evaluate_by_batch(examples, per_device_batch_size)
            totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
            count = count + n
        totals, count = to_host((totals, count))
        return {k: float(v) / float(count) for k, v in totals.items()}

    def _eval_mode(self, examples, idx, n_real, batch, sums, spread):
        """"batch" where ``loss_fn`` is defined over the batch: every example alone gives the
        same loss (a contrastive loss gives 0) but the whole batch another; else "example"."""
        low, high, total = (float(x) for x in to_host((*spread, sums["loss"])))
        if n_real < 2 or high - low > 1e-6 * max(abs(low), abs(high), 1e-30):
            return "example"
        whole, n = self._batch_sums(examples, idx, n_real, batch)
        batch_loss = float(to_host(whole["loss"])) / float(n)
        if abs(batch_loss - total / n_real) <= 1e-5 * max(abs(batch_loss), 1e-6):
            return "example"
        self.deployer.log_info(
            f"loss_fn gives every example of the first evaluation batch alone the same loss "
            f"({low:.6g}) but the batch {batch_loss:.6g}: it is defined over the batch, so "
            "evaluation applies it to whole batches (the last, smaller batch as it is). Pass "
            "Trainer(..., eval_by='batch') to say so, or eval_by='example' to keep the mean "
            "over single examples.")
        return "batch"

    def _evaluate_by_batch(self, examples, per_device_batch_size):
        """Means of ``loss_fn`` over whole batches, weighted by their rows; the last, smaller
        batch is collated whole on every process and placed replicated, never padded."""
        global_batch = self.global_batch_size(per_device_batch_size)
        maker = BatchMaker(self.mesh, self.collate_fn, global_batch)
        totals, count = None, 0.0
        for idx, n_real in padded_batches(len(examples), global_batch):
            batch = maker.make(examples, idx) if n_real == global_batch else None
            sums, n = self._batch_sums(examples, idx, n_real, batch)
            heartbeat()
            totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
            count = count + n
        totals, count = to_host((totals, count))
        return {k: float(v) / float(count) for k, v in totals.items()}

    def _batch_sums(self, examples, idx, n_real, batch):
        """``loss_fn`` on one whole batch (``batch``, placed; or, when the batch is the last and
        smaller one, its ``n_real`` examples of ``idx`` collated whole and placed replicated)."""
        if n_real == len(idx):
            return self.layout.batch_eval_step(self._state, batch, self._eval_rng)
        rest = check_collated(self.collate_fn(take(examples, idx[:n_real])), n_real)
        return self.layout.remainder_eval_step(self._state, jax.device_put(rest, self.layout.replicated),
                                               self._eval_rng)

    def eval_loss(self, examples, per_device_batch_size, desc=None):
        """The mean loss over ``examples`` (loss_fn called with ``is_training=False``)."""
        return self._evaluate(examples, per_device_batch_size, desc=desc)["loss"]

    def evaluate(self, examples, per_device_batch_size):
        """``{"loss": ..., name: ...}``: the means over ``examples`` of the loss and of every
        metric ``loss_fn`` returns (``is_training=False``), each example counted exactly once."""
        return self._evaluate(examples, per_device_batch_size)

    def save_params(self, path):
        """Write the current parameters as a safetensors file (readable without redcoast)."""
        self._require_concrete("save parameters")
        save_params(self.params, path)

    def check_layout(self, examples, per_device_batch_size, rtol=None):
        """Check the layout this trainer runs in (chosen now if not yet) against one device:
        the loss, metrics and gradients of the first ``per_device_batch_size`` x data shards
        of ``examples`` (a sequence), computed as the training step computes them and by
        ``loss_fn`` as written on one device of this process (the model must fit it). Returns a
        :class:`~redcoast.layout_check.LayoutCheck` naming the worst leaf; raises
        :class:`~redcoast.layout_check.LayoutCheckError` where an error is above ``rtol``
        (default 1e-4 in float32 compute, 5e-2 in 16-bit), or above 10x the change one rounding
        of the parameters makes to the one-device gradients where that is more. Nothing is
        trained."""
        self._require_concrete("check its layout against one device")
        if not is_sequence(examples):
            raise ConfigError(f"check_layout takes a sequence of examples (a list, a Dataset), "
                              f"not {type(examples).__name__}. Fix: pass list(...) of a few batches.")

        def micro_batch(mesh):
            n = per_device_batch_size * mesh.shape["dp"]
            if len(examples) < n:
                raise ConfigError(f"check_layout needs {n} examples (per_device_batch_size="
                                  f"{per_device_batch_size} x {mesh.shape['dp']} data shards); "
                                  f"{len(examples)} were given.")
            return BatchMaker(mesh, self.collate_fn, n).make(examples, np.arange(n))

        self._settle_layout(micro_batch)
        return self._check_layout_on(micro_batch(self.mesh), rtol)

    def _check_layout_on(self, batch, rtol):
        """Check the current layout on one micro-batch (placed); raise if it fails."""
        report = check_layout(self.layout, self.recipe, self._state, batch, self._train_rng, rtol)
        self._layout_checked = True
        if not report.ok:
            raise LayoutCheckError(
                f"{report}\nThis is a bug in redcoast's layout (please report it with this "
                "message). Until it is fixed, train in a layout that passes this check: try "
                "fuse_matmuls=False, then fsdp=False, then n_model_shards=1.")
        self.deployer.log_info(str(report))
        return report

    # ----------------------------------------------------------------------------- checkpoints

    @staticmethod
    def _saved_part(state):
        """What a checkpoint holds of a TrainState (of arrays, or of their shardings)."""
        return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
                "nonfinite_step": state.nonfinite_step}

    def _abstract_state(self):
        return jax.tree_util.tree_map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
            self._saved_part(self._state), self._saved_part(self.layout.state_shardings))

    def save_checkpoint(self, store, epoch, position, config=None, examples_consumed=None,
                        stream_fingerprint=None):
        """Start saving the full training state to ``store`` (a :class:`CheckpointStore`);
        ``(epoch, position, examples_consumed)``: where a run resumed from it starts: ``position``
        updates and ``examples_consumed`` examples (in the epoch's order) into ``epoch``. Left
        None, ``examples_consumed`` is ``position`` updates of ``config``'s size where it has one.
        ``stream_fingerprint``: of a stream's consumed examples, for the resume to compare."""
        self._check_finite()
        if examples_consumed is None and (position == 0 or _per_update(config) is not None):
            examples_consumed = position * (_per_update(config) or 0)
        meta = {"step": self._host_step, "epoch": int(epoch), "position": int(position),
                "train_rng": key_to_json(to_host(self._train_rng)),
                "eval_rng": key_to_json(to_host(self._eval_rng)),
                "best": dict(self._best), "config": config or {}}
        if examples_consumed is not None:  # what a resume skips, whatever its batch size
            meta["examples_consumed"] = int(examples_consumed)
        if stream_fingerprint is not None:  # and what those examples were
            meta["stream_fingerprint"] = stream_fingerprint
        meta["frozen_params"] = fingerprint(self._state.frozen_params)  # which base adapters need
        store.save(self._host_step, self._saved_part(self.state), meta)  # in the user's layout
        return meta

    def restore_checkpoint(self, store):
        """Load the newest complete checkpoint of ``store`` onto this mesh; its meta, or None."""
        restored = store.restore_latest_or_fail(self._abstract_state())
        if restored is None:
            return None
        arrays, meta = restored
        check_fingerprint(meta.get("frozen_params"), self._state.frozen_params,  # its base
                          where=f"The checkpoint {store.directory}/{meta['step']}")
        self._state = self.layout.stored.state_to_storage(self._state.replace(**arrays))
        self._host_step = int(meta["step"])
        self._train_rng = jax.device_put(key_from_json(meta["train_rng"]), self.layout.replicated)
        self._eval_rng = jax.device_put(key_from_json(meta["eval_rng"]), self.layout.replicated)
        self._best = dict(meta.get("best", {}))
        return meta

    def fit(self, train_examples, per_device_batch_size, n_epochs, eval_examples=None,
            eval_per_device_batch_size=None, eval_loss=True, eval_predictor=None,
            eval_metric_fn=None, save_every_n_steps=None, save_every_k_epochs=None,
            save_last_ckpt=False, save_argmin_ckpt_by_metrics=None,
            save_argmax_ckpt_by_metrics=None, keep_last_n_ckpts=None, resume=True,
            log_every_n_steps=10, shuffle=True, max_steps=None, eval_every_n_steps=None,
            check_layout=False):
        """Train for ``n_epochs`` (or until ``max_steps`` updates in all, whichever comes first;
        ``n_epochs=None`` with ``max_steps``: as many epochs as that takes), evaluating after each
        epoch, every ``eval_every_n_steps`` updates and at ``max_steps``, saving and resuming as
        asked.

        ``train_examples``: a sequence (a list, a ``datasets.Dataset``), shuffled each epoch
        from the seed; any other iterable (a generator, a ``datasets.IterableDataset``) is
        streamed in order, an update at a time, an epoch ending where it ends (an endless one
        needs ``max_steps``); or a function of the epoch returning either (see
        :func:`redcoast.data.examples_by_epoch`). The last incomplete update of an epoch is not
        trained on. ``eval_metric_fn(eval_examples, predictions) -> dict`` scores
        ``eval_predictor``'s predictions. Checkpoints go to ``workdir/checkpoints``: ``steps/``
        every ``save_every_n_steps`` updates, every ``save_every_k_epochs`` epochs, at the end
        (``save_last_ckpt``) and on SIGTERM/SIGINT; ``best_min_<name>/`` and ``best_max_<name>/``
        keep the best by an eval result ('loss' or a key of ``eval_metric_fn``'s dict). With
        ``resume`` (default) a run whose workdir holds a checkpoint continues from it, mid-epoch,
        exactly as if it had never stopped (a stream is started afresh and the examples already
        trained on skipped); resumed with another batch size, the epoch goes on at its first
        example not trained yet. A checkpoint is written before the evaluation that follows it;
        an evaluation that fails raises :class:`~redcoast.errors.EvaluationError`, which says
        where that checkpoint is.
        ``check_layout=True``: before the first update, the layout is checked against one
        device on the first batch (see :meth:`check_layout`).
        """
        self._require_concrete("fit")
        validate.fit_args(per_device_batch_size, n_epochs, eval_examples,
                          eval_per_device_batch_size, save_every_n_steps, save_every_k_epochs,
                          keep_last_n_ckpts, log_every_n_steps, train_examples,
                          max_steps=max_steps, eval_every_n_steps=eval_every_n_steps)
        save_min = list(save_argmin_ckpt_by_metrics or [])
        save_max = list(save_argmax_ckpt_by_metrics or [])
        wants_saving = bool(save_every_n_steps or save_every_k_epochs or save_last_ckpt
                            or save_min or save_max)
        workdir = self.deployer.workdir
        if wants_saving and workdir is None:
            raise ConfigError("Saving checkpoints needs a workdir. Fix: pass workdir=... to Deployer.")
        eval_bs = eval_per_device_batch_size or per_device_batch_size
        one_shot = is_iterator(train_examples)
        examples_of = examples_by_epoch(train_examples)  # epoch -> a sequence or a Stream
        first = examples_of(self._first_epoch)
        streamed = isinstance(first, Stream)
        if streamed and first.endless and max_steps is None:
            raise ConfigError("train_examples never ends, so its first epoch would never end. Fix: "
                              "pass max_steps=... (the number of updates to train for).")
        if one_shot and max_steps is None and n_epochs > 1:
            raise ConfigError(
                f"train_examples is an iterator ({type(train_examples).__name__}), which can be "
                f"read once, but n_epochs={n_epochs}. Fix: pass a function returning a fresh "
                "iterator each epoch (e.g. `lambda epoch: my_generator(epoch)`), a re-iterable "
                "(a list, a datasets.IterableDataset), or n_epochs=1.")
        if one_shot and not first.endless and (n_epochs is None or n_epochs > 1):
            # read once, so its one pass is the run's last epoch: saved and evaluated as such,
            # not an error at the start of a second epoch after the first went unsaved
            self.deployer.log_warning(
                f"train_examples is an iterator ({type(train_examples).__name__}), which can be "
                f"read once: this run trains one pass over it (n_epochs={n_epochs} and "
                f"max_steps={max_steps} notwithstanding), stopping where it ends or at max_steps. "
                "Fix, for more: pass a function returning a fresh iterator each epoch (e.g. "
                "`lambda epoch: my_generator(epoch)`) or a re-iterable.")
            n_epochs = self._first_epoch + 1
        order = None if streamed else epoch_order(len(first), self.deployer.jax_seed, 0, shuffle)
        # the layout first: checkpoints are restored straight into it
        self._settle_layout(lambda mesh: self._first_batch(first, order, per_device_batch_size, mesh))
        n_steps = None if streamed else self.updates_per_epoch(len(first), per_device_batch_size)
        config = {"jax_seed": self.deployer.jax_seed, "n_model_shards": self.layout.n_model_shards,
                  "n_data_shards": self.layout.n_data_shards, "n_processes": jax.process_count(),
                  "global_batch_size": self.global_batch_size(per_device_batch_size),
                  "accumulate_grad_batches": self.accumulate_grad_batches,
                  "train_size": None if streamed else len(first), "n_epochs": n_epochs,
                  "max_steps": max_steps, "shuffle": shuffle,
                  "compute_dtype": str(jnp.dtype(self.compute_dtype))}
        per_update = config["global_batch_size"] * self.accumulate_grad_batches
        fixed = is_sequence(train_examples)  # the same examples every epoch
        if fixed and len(first) % per_update:  # said once, not every epoch
            self.deployer.log_info(
                f"each epoch trains on {n_steps * per_update} of the {len(first)} examples: the "
                f"last {len(first) % per_update} of its order (shuffled anew each epoch) do not "
                f"fill an update of {per_update} and are left out.")
        store = lock = None
        if workdir is not None and (wants_saving or resume):
            lock = WorkdirLock(workdir, logger=self.deployer.logger).acquire()
            try:
                store = self._open_store(workdir, keep_last_n_ckpts, resume)
            except BaseException:
                lock.release()
                raise
        try:  # from here on, whatever happens, the store is closed and the lock released
            # where this run starts: an epoch, updates and examples (in the epoch's order) into it
            start_epoch, start_position, start_example = self._first_epoch, 0, 0
            resumed_fingerprint = None  # of a stream's examples the checkpoint's run consumed
            saved = []  # (step, epoch, position, directory) of the newest checkpoint on disk
            if resume and store is not None and store.steps():
                meta = self.restore_checkpoint(store)
                if meta is not None:
                    start_epoch, start_position = meta["epoch"], meta["position"]
                    start_example = self._examples_consumed(meta, per_update)
                    resumed_fingerprint = meta.get("stream_fingerprint")
                    saved.append((meta["step"], start_epoch, start_position, store.directory))
                    self._best.update(self._best_on_disk(workdir))
                    self._warn_if_config_changed(meta.get("config", {}), config)
                    into = f"{start_position} update{'' if start_position == 1 else 's'} into it"
                    if start_example:
                        resumed = None if streamed else examples_of(start_epoch)
                        listed = resumed is not None and is_sequence(resumed)
                        into += (f": its first {start_example} examples"
                                 f"{' (in its order)' if listed else ''} were trained before the "
                                 "checkpoint and are skipped")
                        if listed:
                            left = _updates_after(len(resumed), start_example, per_update, start_epoch)
                            into += f"; {left} updates of {per_update} remain"
                    self.deployer.log_info(
                        f"resumed from {store.directory}/{meta['step']}: step {meta['step']}, epoch "
                        f"{start_epoch + 1}, {into}")
                    if one_shot and start_example:
                        self.deployer.log_warning(
                            f"train_examples is an iterator ({type(train_examples).__name__}), which "
                            f"cannot be rewound: resuming skips the first {start_example} "
                            "examples it gives, as the interrupted run trained on those; that is "
                            "right only if it starts where that run's started. Fix: pass a function "
                            "returning a fresh iterator (`lambda epoch: my_generator(epoch)`, or one "
                            "with no argument) or a re-iterable (a datasets.IterableDataset).")
            if eval_examples is not None and eval_loss:
                self._check_eval_loss(eval_examples)  # now, not after the first epoch has trained

            def stream_fingerprint(n):  # of the epoch's first n examples, when it streams
                stream = begun.get("stream")
                return None if stream is None or not n else stream.fingerprint(n)

            def save(epoch, position, consumed):
                if store is not None:
                    self.save_checkpoint(store, epoch, position, config, examples_consumed=consumed,
                                         stream_fingerprint=stream_fingerprint(consumed))
                    saved[:] = [(self._host_step, epoch, position, store.directory)]

            multi_process = jax.process_count() > 1
            evaluation = (eval_examples, eval_bs, eval_loss, eval_predictor, eval_metric_fn)
            evaluated = {}  # host step -> eval results (one evaluation per step)

            def evaluate(label):
                """Evaluate after ``label``, once per step; a failure says what is saved."""
                if self._host_step not in evaluated:
                    evaluated.clear()
                    evaluated[self._host_step] = self._evaluate_epoch(
                        *evaluation, label, lambda: self._saved_note(saved, store))
                return evaluated[self._host_step]

            stopped = []  # why the last epoch's train() stopped early: "max_steps" or "signal"
            end = (n_epochs, 0, 0)  # where a run continuing this one would start
            # this epoch's start in updates and examples: updates after it are of per_update examples
            begun = {"position": start_position, "example": start_example}

            def consumed(position):
                return begun["example"] + (position - begun["position"]) * per_update

            with PreemptionGuard() as guard:
                def after_step(position):
                    step = self._host_step
                    if save_every_n_steps and step % save_every_n_steps == 0:
                        save(epoch, position, consumed(position))  # kept if the evaluation fails
                    if eval_every_n_steps and step % eval_every_n_steps == 0:
                        results = evaluate(f"step {step}")
                        self._save_best(results, epoch, position, consumed(position), save_min,
                                        save_max, workdir, config)
                    if max_steps is not None and step >= max_steps:
                        stopped.append("max_steps")
                        return True
                    # one process alone may get the signal: agree at the logging interval
                    check = position % log_every_n_steps == 0 or position == n_steps or not multi_process
                    if check and guard.requested_anywhere():
                        stopped.append("signal")
                        return True
                    return False

                epochs = (range(start_epoch, n_epochs) if n_epochs is not None
                          else itertools.count(start_epoch))
                for epoch in epochs:
                    resumed_epoch = epoch == start_epoch
                    begun["position"] = start_position if resumed_epoch else 0
                    begun["example"] = start_example if resumed_epoch else 0
                    if max_steps is not None and self._host_step >= max_steps:  # resumed at the end
                        end = (epoch, begun["position"], begun["example"])
                        break
                    train_examples = examples_of(epoch)
                    streamed = isinstance(train_examples, Stream)  # a function may change kind
                    begun["stream"] = train_examples if streamed else None
                    position = begun["position"]
                    if streamed:
                        n_steps = None
                    else:
                        self.updates_per_epoch(len(train_examples), per_device_batch_size)  # one fits
                        n_steps = position + _updates_after(len(train_examples), begun["example"],
                                                            per_update, epoch)
                    stopped.clear()
                    of = f"/{n_epochs}" if n_epochs is not None else ""
                    if n_steps is None or position < n_steps:
                        position = self.train(train_examples, per_device_batch_size, epoch=epoch,
                                              shuffle=shuffle, desc=f"epoch {epoch + 1}{of}",
                                              log_every_n_steps=log_every_n_steps,
                                              start_position=position, after_step=after_step,
                                              start_example=begun["example"],
                                              check_layout=check_layout,
                                              start_fingerprint=(resumed_fingerprint
                                                                 if resumed_epoch else None))
                    # a stream's end is known only once read: stopped early, it may hold more
                    finished = not stopped or position == n_steps
                    if not finished and stopped[0] == "signal":
                        self._stop_for_preemption(store, guard, epoch, position, consumed(position),
                                                  config, stream_fingerprint(consumed(position)))
                    last = ((stopped and stopped[0] == "max_steps") or
                            (n_epochs is not None and epoch + 1 == n_epochs))
                    if finished:
                        # resumed at an example that is not a multiple of the update: said anew
                        anew = (begun["example"] % per_update) != 0
                        left = (train_examples.leftover if streamed else
                                0 if fixed and not anew else
                                (len(train_examples) - begun["example"]) % per_update)
                        if left:
                            self.deployer.log_info(
                                f"epoch {epoch + 1}: its last {left} examples do not fill an "
                                f"update of {per_update} and were left out.")
                        # saved before the evaluation, so an evaluation that fails loses no training
                        if ((save_every_k_epochs and (epoch + 1) % save_every_k_epochs == 0)
                                or (save_last_ckpt and last)):
                            save(epoch + 1, 0, 0)
                        results = evaluate(f"epoch {epoch + 1}{of}")
                        self._save_best(results, epoch + 1, 0, 0, save_min, save_max, workdir, config)
                    if stopped and stopped[0] == "max_steps":
                        end = (epoch + 1, 0, 0) if finished else (epoch, position, consumed(position))
                        if not finished:
                            if save_last_ckpt:
                                save(*end)
                            results = evaluate(f"step {self._host_step} (max_steps)")
                            self._save_best(results, *end, save_min, save_max, workdir, config)
                        break
                    if guard.requested_anywhere():
                        self._stop_for_preemption(store, guard, epoch + 1, 0, 0, config)
                if save_last_ckpt:
                    save(*end)
        finally:  # whatever happened, finish writing the checkpoints already started
            if store is not None:
                store.close()
            if lock is not None:
                lock.release()

    def _open_store(self, workdir, keep_last_n_ckpts, resume):
        """The run's checkpoint store; with ``resume=False`` an earlier run's checkpoints are
        moved aside (never overwritten, never silently kept in place of this run's)."""
        directory = os.path.join(workdir, "checkpoints")
        store = CheckpointStore(os.path.join(directory, "steps"), keep_last_n=keep_last_n_ckpts,
                                logger=self.deployer.logger)
        # process 0 decides (the others might look after it moved the directory)
        if resume or not agree(store.steps() or _has_best(directory)):
            return store
        store.close()
        aside = move_aside(directory, "earlier-run", self.deployer.logger)
        self.deployer.log_warning(f"resume=False: the checkpoints of an earlier run in {directory} "
                                  f"were moved to {aside}; this run starts afresh.")
        return CheckpointStore(os.path.join(directory, "steps"), keep_last_n=keep_last_n_ckpts,
                               logger=self.deployer.logger)

    def _stop_for_preemption(self, store, guard, epoch, position, consumed, config,
                             stream_fingerprint=None):
        if store is not None:
            self.save_checkpoint(store, epoch, position, config, examples_consumed=consumed,
                                 stream_fingerprint=stream_fingerprint)
            store.wait()
            where = f"saved a checkpoint at step {self._host_step} in {store.directory}"
            self.deployer.log_info(f"stopped by {guard.signal_name or 'a signal on another process'}"
                                   f": {where}. Run the same command again to continue.")
            raise SystemExit(0)
        # nothing to continue from: a failure status (128 + the signal, as a shell reports it)
        self.deployer.log_warning(
            f"stopped by {guard.signal_name or 'a signal on another process'} after step "
            f"{self._host_step}: the Deployer has no workdir, so nothing was saved and running "
            "again starts from the beginning. Fix: Deployer(..., workdir='...') to resume.")
        raise SystemExit(128 + signal.Signals[guard.signal_name].value if guard.signal_name else 1)

    def _evaluate_epoch(self, eval_examples, eval_bs, eval_loss, eval_predictor, eval_metric_fn,
                        label, saved_note=None):
        """The eval results after ``label``; an error in any part is raised as an
        :class:`EvaluationError` naming that part and ``saved_note()`` (what is saved)."""
        results = {}
        if eval_examples is None:
            return results
        part = "the eval loss (collate_fn or loss_fn with is_training=False)"
        try:
            if eval_loss:
                results.update(self._evaluate(eval_examples, eval_bs))
            if eval_predictor is not None:
                part = "eval_predictor (collate_fn, pred_fn or output_fn)"
                preds = eval_predictor.predict(eval_examples, eval_bs, params=self.params)
                if eval_metric_fn is not None:
                    part = "eval_metric_fn"
                    metrics = eval_metric_fn(eval_examples, preds)
                    if not isinstance(metrics, Mapping):
                        raise ConfigError(
                            f"eval_metric_fn returned {type(metrics).__name__} ({metrics!r:.60}); "
                            "it must return a dict of named results, e.g. {'accuracy': 0.93}, as "
                            "redco's did. Fix: return a dict from eval_metric_fn.")
                    results.update(metrics)
        except Exception as e:
            note = saved_note() if saved_note is not None else ""
            raise EvaluationError(f"the evaluation after {label} failed in {part}: "
                                  f"{type(e).__name__}: {e}" + (f"; {note}" if note else "")) from e
        if results:
            shown = ", ".join(f"{k} = {v:.4f}" if isinstance(v, float) else f"{k} = {v}"
                              for k, v in results.items())
            self.deployer.log_info(f"{label}: eval {shown}")
            self.deployer.log_metrics({f"eval_{k}": v for k, v in results.items()}, self._host_step)
        return results

    def _save_best(self, results, epoch, position, consumed, save_min, save_max, workdir, config):
        """Keep the best checkpoints by eval results; ``(epoch, position, consumed)``: where a
        run resumed from one would start."""
        for name, better in [(m, min) for m in save_min] + [(m, max) for m in save_max]:
            if name not in results:
                raise ConfigError(f"Cannot keep the best checkpoint by '{name}': the evaluation "
                                  f"gave {sorted(results)}. Fix: name one of those.")
            value = float(results[name])
            tag = f"best_{better.__name__}_{name}"
            if math.isnan(value) or (tag in self._best and better(value, self._best[tag]) == self._best[tag]):
                continue
            self._best[tag] = value
            best_store = CheckpointStore(os.path.join(workdir, "checkpoints", tag), keep_last_n=1,
                                         logger=self.deployer.logger, replace_existing=True)
            self.save_checkpoint(best_store, epoch, position, config, examples_consumed=consumed)
            best_store.close()
            self.deployer.log_info(f"saved the best checkpoint by {name} = {value:.4f} "
                                   f"(step {self._host_step}) in {best_store.directory}")

    def _best_on_disk(self, workdir):
        """``{tag: value}`` of the best checkpoints kept in ``workdir``: a step's checkpoint is
        written before its evaluation, so its record may not hold the best that evaluation kept."""
        from etils import epath
        directory = epath.Path(workdir) / "checkpoints"
        best = {}
        for path in sorted(directory.iterdir()) if directory.exists() else []:
            if not path.name.startswith("best_"):
                continue
            best_store = CheckpointStore(str(path), logger=self.deployer.logger)
            meta = best_store.latest_meta()
            best_store.close()
            if meta is not None and path.name in meta.get("best", {}):
                best[path.name] = meta["best"][path.name]
        return best

    def _examples_consumed(self, meta, per_update):
        """Examples of the checkpoint's epoch (in its order) trained before it. A checkpoint of
        the previous format records only updates: of the size its config records, else (with a
        warning) of this run's."""
        if "examples_consumed" in meta:
            return int(meta["examples_consumed"])
        position = int(meta["position"])
        recorded = _per_update(meta.get("config"))
        if position == 0 or recorded is not None:
            return position * (recorded or 0)
        self.deployer.log_warning(
            f"the checkpoint at step {meta['step']} does not record how many examples of epoch "
            f"{meta['epoch'] + 1} it trained, only {position} updates, nor their size: taking "
            f"this run's updates of {per_update}, so {position * per_update} examples are skipped. "
            "If the interrupted run used another batch size, examples are skipped or repeated. "
            "Fix: resume with that run's per_device_batch_size, devices and "
            "accumulate_grad_batches.")
        return position * per_update

    def _check_eval_loss(self, eval_examples):
        """Trace (not run) ``loss_fn`` with ``is_training=False`` on one eval example, as the
        evaluation calls it, so that what it returns there is checked before any training."""
        if self.loss_fn is None:
            return
        import random
        from .steps import cast_floating, split_loss_output, with_frozen_cast
        # a collate_fn drawing from the global random generators (masking, augmentation) must
        # draw for training exactly what it drew before this check existed
        states = random.getstate(), np.random.get_state()
        try:
            batch = _abstract(check_collated(self.collate_fn(take(eval_examples, [0])), 1))
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
        dtype = self.compute_dtype

        def eval_loss(state, batch, rng):
            return split_loss_output(self.loss_fn(rng, with_frozen_cast(state, dtype),
                                                  cast_floating(state.params, dtype), batch, False))
        try:
            # the stored state: the user's shapes, and nothing computed to present it
            jax.eval_shape(eval_loss, self._state, batch, self._eval_rng)
        except LossError as e:
            raise LossError(
                f"{e} (Found before any training, by tracing loss_fn with is_training=False as "
                "the evaluation of eval_examples calls it; or pass eval_loss=False to evaluate "
                "with eval_predictor alone.)") from e
        except Exception:  # noqa: BLE001 - anything else the evaluation itself reports, in full
            pass

    def _saved_note(self, saved, store):
        """What is on disk for a rerun to resume from (said when an evaluation fails)."""
        if store is None:
            how = ("pass workdir=... to Deployer" if self.deployer.workdir is None else
                   "pass save_every_k_epochs=1 (or save_every_n_steps=...) to fit")
            return (f"no checkpoint was saved, so a rerun starts afresh. Fix: correct it, and "
                    f"{how} to keep the training done before an evaluation.")
        if not saved:
            return ("no checkpoint has been saved in this run, so a rerun starts afresh (fit "
                    "saves every save_every_k_epochs epochs and every save_every_n_steps updates, "
                    "before evaluating). Fix: correct it and run again.")
        step, epoch, position, directory = saved[0]
        if step == self._host_step:
            what = f"epoch {epoch}" if position == 0 else f"step {step}"
            return (f"{what} is saved at {directory}/{step} and a rerun resumes from there. "
                    "Fix: correct it and run the same command again.")
        return (f"the newest checkpoint is {directory}/{step} (step {step}): a rerun resumes "
                f"from there and trains the {self._host_step - step} updates since again. Fix: "
                "correct it and run the same command again.")

    def _warn_if_config_changed(self, saved, current):
        def changed(keys):
            return ", ".join(f"{k} ({saved[k]} -> {current[k]})" for k in keys
                             if k in saved and saved[k] != current[k])
        order = changed(("jax_seed", "train_size", "shuffle"))
        if order:
            self.deployer.log_warning(f"resuming with a different {order}: the data order "
                                      "changes, so the run will not repeat the interrupted one.")
        grouping = changed(("global_batch_size", "accumulate_grad_batches"))
        if grouping:  # the order of the examples does not depend on the batch size
            self.deployer.log_warning(
                f"resuming with a different {grouping}: the epoch goes on at the first example "
                "the interrupted run had not trained, in the same order, but in updates of "
                "another size, so the run will not repeat the interrupted one exactly.")


def _has_best(directory):
    from etils import epath
    path = epath.Path(directory)
    return path.exists() and any(p.name.startswith("best_") for p in path.iterdir())


def _nonfinite_message(step, value):
    return (f"The training loss became {value} at step {step} (counting from 0), so training "
            "stopped and no checkpoint was written after it; the last checkpoint on disk, if any, "
            "is from before it. Fix: lower the learning rate, add warmup or gradient clipping "
            "(optax.clip_by_global_norm), or check that step's batch for bad values.")


def _updates_per_epoch(n_examples, per_device_batch_size, n_data_shards, accumulate_grad_batches):
    per_update = per_device_batch_size * n_data_shards * accumulate_grad_batches
    if n_examples < per_update:
        raise ConfigError(
            f"{n_examples} training examples do not fill one update of {per_update} "
            f"(per_device_batch_size={per_device_batch_size} x {n_data_shards} data shards x "
            f"accumulate_grad_batches={accumulate_grad_batches}). Fix: use a smaller batch size.")
    return n_examples // per_update


def _per_update(config):
    """Examples per update recorded in a run's ``config``, or None."""
    config = config or {}
    if config.get("global_batch_size") is None or config.get("accumulate_grad_batches") is None:
        return None
    return int(config["global_batch_size"]) * int(config["accumulate_grad_batches"])


def _updates_after(n_examples, consumed, per_update, epoch):
    """Updates of ``per_update`` left in an epoch of ``n_examples`` once ``consumed`` are trained."""
    if consumed > n_examples:
        raise DataError(
            f"epoch {epoch + 1} has {n_examples} training examples, but {consumed} of them were "
            "trained on before the resumed checkpoint: these are not the examples the interrupted "
            "run trained on. Fix: give the same examples on resume, or resume=False.")
    return (n_examples - consumed) // per_update


def _describe_nonfinite(history):
    losses = [float(m["loss"]) for m in history]
    bad = [x for x in losses if not math.isfinite(x)]
    return str(bad[0]) if bad else "NaN or inf"


def _abstract(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(getattr(x, "shape", None) or np.shape(x), x.dtype), tree)


def _copy_tree(tree):
    return jax.tree_util.tree_map(jnp.copy, tree)
