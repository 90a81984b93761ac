"""The training loop around one jitted, sharded step.

How ``fit`` reaches the compiled step, and the words the code uses, are in docs/design.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from . import validate
from .callbacks import Callback, History
from .data import BatchMaker, EpochData, prefetch, updates_per_epoch
from .errors import DATA_CAUSES, ConfigError, NonFiniteLossError
from .export import save_params
from .layout import megatron_bytes
from .layout.abstract import placed
from .layout.check import check_or_raise, first_rows
from .layout.choice import batches_like, choose_run_layout, moved_to
from .layout.fsdp_cost import state_fills_a_device
from .layout.layout import BY_COST, Candidate, Recipe, build_layout, lower_train_step
from .loop.actions import fit_actions
from .loop.batch_diagnosis import nan_findings
from .loop.evaluation import EvalRun, check_eval_loss, first_eval_batch
from .loop.fit_run import Evaluation, FitRun, Schedule, epochs_of
from .loop.in_flight import InFlight
from .loop.initial_state import initial_state, with_opt_state, with_params
from .loop.step_meter import LogWindow, StepMeter
from .multihost.heartbeat import heartbeat
from .multihost.host import to_host
from .predictor import Predictor
from .progress import Progress, checkpoint_meta, examples_trained, saved_part
from .store.fingerprint import check_fingerprint, fingerprint


class Trainer:
    """Trains ``params`` with ``loss_fn`` on the deployer's mesh.

    ``loss_fn(rng, state, params, batch, is_training)`` returns a scalar loss or
    ``(loss, {name: scalar})``; ``params`` arrive in ``compute_dtype``. Parameter placement comes
    from ``params_sharding_rules`` (the paper's format) where given, automatic rules elsewhere.
    ``train_step_fn(state, batch, rng) -> (state, metrics)`` replaces the built-in step.
    ``fsdp=True`` also splits every parameter it can and its optimizer state over the
    data-parallel axis (ZeRO-3), so each device holds about 1/device_count of them; ``fsdp=False``
    keeps one copy per data shard; None (the default) splits the tensors whose gathers cost the
    step less than 2% of its estimated time, largest first, and all of them where the state would
    fill half a device (redcoast/layout/fsdp_cost.py; decided at the first batch without compiling).
    ``fuse_matmuls=True`` (the default with the built-in step) runs sibling matmuls (Q/K/V,
    gate/up) of a split model as one, so the step moves Megatron-LM's bytes between model shards.
    ``trainer.layout`` says what was chosen and why.
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
        validate.trainer_args(collate_fn, loss_fn, optimizer, train_step_fn, params, frozen_params,
                              accumulate_grad_batches, eval_by)
        self._eval_by = eval_by
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
        # None: FSDP of the tensors worth splitting, decided at the first batch (fsdp_cost.py;
        # until then FSDP on), and fusion with the built-in step (sharding/fusion.py)
        self._options = {"fsdp": [BY_COST] if fsdp is None else [bool(fsdp)],
                         "fuse_matmuls": [train_step_fn is None if fuse_matmuls is None
                                          else bool(fuse_matmuls)]}
        self._start(params, optimizer, apply_fn, frozen_params,
                    self._first_candidate(params, self._options["fsdp"][0], bool(fuse_matmuls)))

    def _first_candidate(self, params, fsdp, fuse_matmuls):
        """The setting the parameters are placed in before the first batch: FSDP by cost starts
        unsplit unless the state would fill a device (the choice needs the traced loss)."""
        if fsdp == BY_COST:
            fsdp = state_fills_a_device(params, self.deployer.n_model_shards,
                                        self.deployer.device_memory_budget())
        return Candidate(self.deployer.n_model_shards, fsdp, fuse_matmuls)

    def _start(self, params, optimizer, apply_fn, frozen_params, first):
        """The state, progress and first layout from ``params``, placed by a plan from their
        shapes alone so that trainer.params is usable at once (initial_state.py); the first
        batch replaces that layout by one traced from the loss's data flow."""
        start = initial_state(self.recipe, self.deployer, params, optimizer, apply_fn,
                              frozen_params, first)
        self._state, self.is_abstract, self._host_keys = start.state, start.abstract, start.host_keys
        self._progress = Progress(train_key=start.keys[0], eval_key=start.keys[1])
        self._opt_state_fresh = True  # tx.init(params): made again, not moved, at the first batch
        self._layout_checked = False  # by check_layout, or by train/fit(check_layout=True)
        self.layout = build_layout(self.recipe, first, self.deployer.mesh, start.plan,
                                   self._state, final=False)
        self._meter = StepMeter(self.layout, self.compute_dtype, self.accumulate_grad_batches,
                                self.deployer)
        self._step_bytes, self._bytes_measured = None, False  # after the layout's first step

    # ----------------------------------------------------------------------------- the run's state

    @property
    def progress(self) -> Progress:
        """Where the run stands on the host (step, epoch, position in it, best results, keys)."""
        return self._progress

    @property
    def step(self) -> int:
        """Optimizer updates applied so far."""
        return self._progress.step

    def set_progress(self, progress: Progress) -> None:
        """Continue the run from ``progress`` (as a checkpoint's): the step counter of the state
        follows ``progress.step``; keys left None in it keep the current ones."""
        progress = progress.keys_from(self._progress)
        if progress.step != self._progress.step and not self.is_abstract:
            self._state = self._state.replace(step=jax.device_put(
                jnp.asarray(progress.step, jnp.int32), self.layout.replicated))
        self._progress = progress

    def restart(self, progress: Progress | None = None, params=None, opt_state=None,
                optimizer=None, apply_fn=None) -> None:
        """Continue from what is given, the rest as it is: ``params`` (with ``optimizer`` and
        ``apply_fn``, default the current ones: a new state, its optimizer state fresh and its
        keys drawn anew, in a layout chosen again at the next batch but with this one's
        settings), then ``opt_state`` (of that optimizer), then ``progress`` (see
        :meth:`set_progress`). E.g. one FedAvg client, or redco's ``last_ckpt_info``."""
        if params is not None or optimizer is not None or apply_fn is not None:
            self._options = {"fsdp": [self.fsdp], "fuse_matmuls": [self.fuse_matmuls]}
            self._start(self.params if params is None else params,
                        optimizer or self._state.tx, apply_fn or self._state.apply_fn,
                        self._state.frozen_params,
                        self._first_candidate(self.params if params is None else params,
                                              self.fsdp, self.fuse_matmuls))
        if opt_state is not None:
            self._state = with_opt_state(self.layout, self._state, opt_state)
            self._opt_state_fresh = False
        if progress is not None:
            self.set_progress(progress)

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

    def set_params(self, params, reset_opt_state=True):
        """Continue from ``params`` (the structure and shapes of ``trainer.params``, e.g. a FedAvg
        round's average) with the steps already compiled; the optimizer state starts afresh
        unless ``reset_opt_state=False``. The caller's arrays are copied, never donated. A
        Trainer built from abstract parameters becomes concrete."""
        validate.live_arrays("params", params)
        self._state = with_params(self.layout, self._state, params, reset_opt_state,
                                  self.is_abstract, self.deployer.platform)
        # kept, the optimizer state is no longer tx.init of these params
        self._opt_state_fresh = self._opt_state_fresh and (reset_opt_state or self.is_abstract)
        if self.is_abstract:  # the keys a Trainer built from these params starts with
            keys = jax.device_put(self._host_keys, self.layout.replicated)
            self._progress = self._progress.replace(train_key=keys[0], eval_key=keys[1])
        self.is_abstract = False

    def _require_concrete(self, doing):
        """Refuse ``doing`` on a Trainer built from abstract parameters."""
        if self.is_abstract:
            raise ConfigError(
                f"this Trainer was built from abstract parameters (jax.ShapeDtypeStruct): it "
                f"plans and compiles (trainer.compile_train_step(batch)) but cannot {doing}. Fix: "
                "trainer.set_params(real parameters of the same shapes) first.")

    # ----------------------------------------------------------------------------- the layout

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

    def _per_update(self, per_device_batch_size):
        """Examples in one optimizer update (all micro-batches)."""
        return self.global_batch_size(per_device_batch_size) * self.accumulate_grad_batches

    def _settle_layout(self, batch_for):
        """Once, before the first step: choose the layout from the loss traced on the first
        batch (``batch_for(mesh)``: a first micro-batch on ``mesh``) and move the state to it."""
        if not self.layout.final:
            # one collate_fn call per mesh, however often the layout and its checks ask
            abstract_batch_for = functools.cache(lambda mesh: _abstract(batch_for(mesh)))
            self._adopt(choose_run_layout(self.recipe, self._state, self._progress.train_key,
                                          self.deployer, self._options, abstract_batch_for))

    def _adopt(self, layout):
        """Run in ``layout`` from now on: the state and random keys move to it (donated)."""
        self._state, keys = moved_to(layout, self.layout, self._state, self.is_abstract,
                                     (self._progress.train_key, self._progress.eval_key),
                                     fresh_opt_state=self._opt_state_fresh)
        self._progress = self._progress.replace(train_key=keys[0], eval_key=keys[1])
        self.layout = layout
        self._step_bytes, self._bytes_measured = None, False  # after the layout's first step
        self._meter = StepMeter(layout, self.compute_dtype, self.accumulate_grad_batches,
                                self.deployer)

    def _first_batch(self, source, per_device_batch_size, mesh):
        """One micro-batch of ``source`` on ``mesh``, for tracing and measuring the step."""
        return source.first_batch(self.collate_fn, per_device_batch_size, mesh,
                                  self.accumulate_grad_batches)

    def compile_train_step(self, example_batch):
        """The compiled training step for global batches shaped like ``example_batch`` (a dict
        as ``collate_fn`` returns, with the micro-batch axis first when accumulating): read its
        ``memory_analysis()`` or ``cost_analysis()``, or its collectives with
        ``redcoast.layout.comms.collective_report``. Fixes the sharding plan, as the first batch would."""
        micro = self._settled_micro_batch(example_batch)  # first: it may change the layout
        return lower_train_step(self.layout, self._state, micro, self.accumulate_grad_batches,
                                self._progress.train_key).compile()

    def _settled_micro_batch(self, example_batch):
        """An abstract micro-batch shaped like ``example_batch`` on the layout it settles."""
        batch_for = batches_like(_abstract(example_batch), self.accumulate_grad_batches,
                                 self.layout.n_data_shards)
        self._settle_layout(batch_for)
        return batch_for(self.mesh)

    def step_cost(self, example_batch):
        """What one update of batches shaped like ``example_batch`` (as for
        :meth:`compile_train_step`) processes and costs, before any run: its examples, tokens,
        matrix-product FLOPs per device counted in the step's trace (scans times their length,
        remat's recomputation included; redcoast/layout/flops.py) and the device's peak, MFU's terms
        (a ``StepCost``). Fixes the sharding plan, as the first batch would."""
        k = self.accumulate_grad_batches
        micro = self._settled_micro_batch(example_batch)
        batch = micro if k == 1 else jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct((k, *x.shape), x.dtype), micro)
        return self._meter.cost(self._state, batch, self._progress.train_key)

    # ----------------------------------------------------------------------------- training

    def get_default_predictor(self, pred_fn, output_fn=None):
        """A :class:`Predictor` sharing this trainer's collate_fn and parameter placement."""
        return Predictor(self.deployer, self.collate_fn, pred_fn, output_fn=output_fn)

    def updates_per_epoch(self, n_examples, per_device_batch_size):
        """Optimizer updates in one epoch (the last incomplete batch is dropped)."""
        return updates_per_epoch(n_examples, per_device_batch_size, self.layout.n_data_shards,
                                 self.accumulate_grad_batches)

    def train(self, examples, per_device_batch_size, desc=None, shuffle=True, epoch=0,
              log_every_n_steps=10, start_position=0, after_step=None, start_example=None,
              check_layout=False, start_fingerprint=None):
        """One pass over ``examples`` (a sequence, shuffled from the seed and ``epoch``; any other
        iterable read in order until it ends; an :class:`~redcoast.data.EpochData` as it is),
        from update ``start_position`` of the epoch and its example ``start_example`` (default:
        ``start_position`` updates of this size; a stream's first ones skipped uncollated, and
        they must have ``start_fingerprint`` where given). The last incomplete update is not
        trained on. ``after_step(position)`` runs after each update; True stops the epoch.
        ``check_layout=True``: the layout is checked against one device first
        (:meth:`check_layout`). Returns the position reached (``trainer.progress``: where the
        run stands)."""
        validate.positive_int("log_every_n_steps", log_every_n_steps)
        self._require_concrete("train")
        source = (examples if isinstance(examples, EpochData) else
                  EpochData(examples, self.deployer.jax_seed, epoch, shuffle))
        first_batch = lambda mesh: self._first_batch(source, per_device_batch_size, mesh)  # noqa: E731
        self._settle_layout(first_batch)
        if check_layout and not self._layout_checked:
            self._check_layout_on(first_batch(self.mesh), rtol=None)
        per_update = self._per_update(per_device_batch_size)
        skip = start_position * per_update if start_example is None else int(start_example)
        if source.length is not None:
            self.updates_per_epoch(source.length, per_device_batch_size)  # one update fits
        left = source.skip_trained(skip, per_update, epoch, start_fingerprint)
        n_steps = None if left is None else start_position + left
        self._progress = self._progress.replace(epoch=epoch, position=start_position, examples=skip)
        maker = BatchMaker(self.mesh, self.collate_fn, self.global_batch_size(per_device_batch_size),
                           micro_batches=self.accumulate_grad_batches)
        batches = prefetch(maker.make(*update) for update in source.updates(per_update))
        bar = tqdm(total=n_steps, initial=start_position, desc=desc or "train", dynamic_ncols=True,
                   disable=not (self.deployer.verbose and jax.process_index() == 0))
        window = LogWindow(log_every_n_steps, n_steps, start_position)
        in_flight = InFlight()  # several processes: a bounded lead over the devices
        # the first update's batch, held until its loss is checked: a NaN loss before any
        # update lies in the data or the starting parameters, and the error says which
        first = None
        try:
            for batch in batches:
                if self._progress.position == start_position:
                    self._meter.require_fits(self._state, batch, self._progress.train_key)
                    first = batch if self._progress.step == 0 else None
                self._state, metrics = self.layout.train_step(self._state, batch,
                                                              self._progress.train_key)
                if not self._bytes_measured:  # its first step: compiled, measured for free
                    self._say_step_bytes(batch)
                heartbeat()  # redcoast launch's watchdog: this process makes progress
                in_flight.add(metrics)
                self._progress = self._progress.after_update(per_update)
                if window.add(metrics, self._progress.position):
                    self._log_train(window, bar, batch, first)
                    first = None
                bar.update(1)
                if after_step is not None and after_step(self._progress.position):
                    break
            if window.pending:  # the end of a stream, or a stop before the logging interval
                self._log_train(window, bar, batch, first)
        finally:
            bar.close()
        if source.stream is not None and skip == 0 and self._progress.position == 0:
            raise ConfigError(
                f"train_examples ended after {source.leftover} examples in epoch {epoch + 1}, "
                f"fewer than one update of {per_update} (per_device_batch_size="
                f"{per_device_batch_size} x {self.layout.n_data_shards} data shards x "
                f"accumulate_grad_batches={self.accumulate_grad_batches}). Fix: use a smaller "
                "batch size.")
        return self._progress.position

    def _say_step_bytes(self, batch):
        """Once per layout, after its first step (its compiled program then at hand): the
        bytes it moves between model shards against Megatron's split of its plan, said in a
        warning when over megatron_share.RATIO times (megatron_bytes.py)."""
        layout, self._bytes_measured = self.layout, True
        if layout.n_model_shards == 1 or layout.plan.megatron_wire_elements() is None:
            return
        compiled = layout.train_step.lower(self._state, batch, self._progress.train_key).compile()
        self._step_bytes, _ = megatron_bytes.said(compiled, layout, self.accumulate_grad_batches,
                                                  self.deployer.log_warning)

    def _check_finite(self):
        """Raise if a loss was NaN or inf (one host sync): such a state is never saved."""
        bad_step = int(to_host(self._state.nonfinite_step))
        if bad_step >= 0:
            self._nonfinite(bad_step, "NaN or inf")

    def _nonfinite(self, bad_step, value, first_batch=None):
        """Stop at the first non-finite loss: the step count goes back to the updates applied
        (those from ``bad_step`` on were not), and the error says so, with what is wrong in
        the parameters (as they were at that step) and, at step 0, in ``first_batch``."""
        self.set_progress(self._progress.replace(step=bad_step))
        checked = bad_step == 0 and first_batch is not None
        findings = nan_findings(self._state, first_batch if checked else None)
        raise NonFiniteLossError.at(bad_step, value, findings, checked)

    def _log_train(self, window, bar, batch, first_batch=None):
        """Pull the metrics of the window's steps (one host sync), check them, and log them
        with the throughput of its timed steps."""
        history, bad_step, timed, elapsed = window.pull(self._state.nonfinite_step)
        if bad_step >= 0:
            self._nonfinite(int(bad_step), NonFiniteLossError.first_bad(history), first_batch)
        means = {k: float(np.mean([m[k] for m in history])) for k in history[-1]}
        if self.lr_schedule_fn is not None:
            means["lr"] = float(self.lr_schedule_fn(self._progress.step - 1))
        if timed and elapsed > 0:  # none when the window held only the compiling step
            cost = self._meter.cost(self._state, batch, self._progress.train_key)
            means.update(cost.rates(timed, elapsed))
        bar.set_postfix({k: f"{v:.4g}" for k, v in means.items() if v is not None},
                        refresh=False)
        self.deployer.log_metrics({f"train_{k}": v for k, v in means.items()}, self._progress.step)
        window.restart()

    def fit(self, train_examples, per_device_batch_size, n_epochs, eval_examples=None,
            eval_per_device_batch_size=None, eval_loss=True, eval_predictor=None,
            eval_metric_fn=None, save_every_n_steps=None, save_every_k_epochs=None,
            save_last_ckpt=None, save_argmin_ckpt_by_metrics=None,
            save_argmax_ckpt_by_metrics=None, keep_last_n_ckpts=None, resume=True,
            log_every_n_steps=10, shuffle=True, max_steps=None, eval_every_n_steps=None,
            check_layout=False, checkpoint_files=None, callbacks=None) -> History:
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
        (``save_last_ckpt``; None, the default: where the Deployer has a workdir and ``resume``
        is on, so that a rerun finds the run complete) and on
        SIGTERM/SIGINT; ``best_min_<name>/`` and ``best_max_<name>/`` keep the best by an eval
        result ('loss' or a key of ``eval_metric_fn``'s dict). With ``resume`` (default) a run
        whose workdir holds a checkpoint continues from it exactly (a stream started afresh,
        what was trained skipped; with another batch size, at the first example not trained
        yet), the metrics the interrupted run logged after it dropped from ``metrics.jsonl``
        and TensorBoard; without one, from the start of ``trainer.progress.epoch``. A run
        complete at its checkpoint (its epochs or ``max_steps`` done, or stopped by a callback
        under the same schedule) logs "already complete at step N" and trains nothing.
        ``callbacks``: :class:`~redcoast.callbacks.Callback` s run after the built-in ones (e.g.
        :class:`~redcoast.callbacks.EarlyStopping`); a resumed run starts them afresh.
        Returns a :class:`~redcoast.callbacks.History`: the metrics this call logged, by step.
        A checkpoint is written before the evaluation that follows it; a failing evaluation
        raises :class:`~redcoast.errors.EvaluationError` naming that checkpoint.
        ``check_layout=True``: the layout is checked against one device first (:meth:`check_layout`).
        ``checkpoint_files``: ``{name: text}`` written into every checkpoint's ``files/`` folder
        (``redcoast train`` keeps the run's YAML there).
        The loop and its between-step actions are in fit_run.py and actions.py.
        """
        self._require_concrete("fit")
        validate.fit_args(per_device_batch_size, n_epochs, eval_examples,
                          eval_per_device_batch_size, save_every_n_steps, save_every_k_epochs,
                          keep_last_n_ckpts, log_every_n_steps, train_examples,
                          max_steps=max_steps, eval_every_n_steps=eval_every_n_steps)
        keep_best = ([(m, min) for m in save_argmin_ckpt_by_metrics or []]
                     + [(m, max) for m in save_argmax_ckpt_by_metrics or []])
        if save_last_ckpt is None:  # a run that resumes saves its end: a rerun finds it complete
            save_last_ckpt = self.deployer.workdir is not None and bool(resume)
        callbacks = validate_callbacks(callbacks)
        wants_saving = bool(save_every_n_steps or save_every_k_epochs or save_last_ckpt or keep_best)
        if wants_saving and self.deployer.workdir is None:
            raise ConfigError("Saving checkpoints needs a workdir. Fix: pass workdir=... to Deployer.")
        examples_of, n_epochs, first = epochs_of(train_examples, n_epochs, max_steps, shuffle,
                                                 self._progress.epoch, self.deployer)
        # the layout first: checkpoints are restored straight into it
        self._settle_layout(lambda mesh: self._first_batch(first, per_device_batch_size, mesh))
        schedule = Schedule.of(examples_of, first, train_examples, n_epochs, max_steps,
                               per_device_batch_size, self._per_update(per_device_batch_size),
                               shuffle, log_every_n_steps, check_layout, self.deployer.log_info)
        evaluation = Evaluation(eval_examples, eval_per_device_batch_size or per_device_batch_size,
                                eval_loss, eval_predictor, eval_metric_fn)
        actions = fit_actions(save_every_n_steps, eval_every_n_steps, max_steps,
                              log_every_n_steps, save_every_k_epochs, save_last_ckpt) + callbacks
        run = FitRun(self, schedule, evaluation, actions, keep_best, files=checkpoint_files)
        history = run.history
        with run.open(keep_last_n_ckpts, resume, wants_saving), \
                self.deployer.logger.reporting_to(history.add):
            if resume:
                run.resume()
            done = run.complete()
            if done is not None:
                self.deployer.log_info(f"already complete at step {self._progress.step} "
                                       f"({done}): nothing to train. Fix, to train on: a larger "
                                       "n_epochs or max_steps; to start afresh: resume=False "
                                       "or another workdir.")
                history.already_complete = True
            else:
                if eval_examples is not None and eval_loss:  # now, not after an epoch trained
                    check_eval_loss(self.loss_fn, self.collate_fn, self.compute_dtype,
                                    self._state, self._progress.eval_key, eval_examples)
                run.train()
        history.stopped_by, history.final_step = run.stopped_by, self._progress.step
        return history

    # ----------------------------------------------------------------------------- evaluation

    def evaluate(self, examples, per_device_batch_size):
        """``{"loss": ..., name: ...}``: the means over ``examples`` of the loss and of every
        metric ``loss_fn`` returns (``is_training=False``), each example counted exactly once:
        ``loss_fn`` applied to one example at a time, or to whole batches (``eval_by``)."""
        self._require_concrete("evaluate")

        self._settle_layout(lambda mesh: first_eval_batch(examples, self.collate_fn,
                                                          per_device_batch_size, mesh))
        run = EvalRun(self.layout, self._state, self._progress.eval_key, self.collate_fn,
                      examples, self.global_batch_size(per_device_batch_size),
                      self.deployer.log_info)
        results, self._eval_by = run.means(self._eval_by)
        if not np.isfinite(results["loss"]):  # said, with what in the data explains it
            findings = nan_findings(self._state, first_eval_batch(
                examples, self.collate_fn, per_device_batch_size, self.mesh))
            self.deployer.log_warning(
                f"The evaluation loss is {results['loss']}. "
                + (f"Found: {'; '.join(findings)}. " if findings else
                   "Its first batch and the parameters hold nothing that explains it; ")
                + f"Check the examples and the loss for {DATA_CAUSES}.")
        return results

    def eval_loss(self, examples, per_device_batch_size, desc=None):
        """The mean loss over ``examples`` (loss_fn called with ``is_training=False``)."""
        return self.evaluate(examples, per_device_batch_size)["loss"]

    def save_params(self, path):
        """Write the current parameters as a safetensors file (readable without redcoast)."""
        self._require_concrete("save parameters")
        save_params(self.params, path)

    def check_layout(self, examples, per_device_batch_size, rtol=None):
        """Check the layout this trainer runs in (chosen now if not yet) against one device:
        the loss, metrics and gradients of the first ``per_device_batch_size`` x data shards
        of ``examples`` (a sequence), computed as the training step computes them and by
        ``loss_fn`` as written on one device of this process (the model must fit it). Returns a
        :class:`~redcoast.layout.check.LayoutCheck` naming the worst leaf; raises
        :class:`~redcoast.layout.check.LayoutCheckError` where an error is above ``rtol``
        (default 1e-4 in float32 compute, 5e-2 in 16-bit), or above 10x the change one rounding
        of the parameters makes to the one-device gradients where that is more. Nothing is
        trained."""
        self._require_concrete("check its layout against one device")
        micro_batch = lambda mesh: first_rows(examples, self.collate_fn, per_device_batch_size, mesh)  # noqa: E731
        self._settle_layout(micro_batch)
        return self._check_layout_on(micro_batch(self.mesh), rtol)

    def _check_layout_on(self, batch, rtol):
        """Check the current layout on one micro-batch (placed); raise if it fails."""
        report = check_or_raise(self.layout, self.recipe, self._state, batch,
                                self._progress.train_key, rtol)
        self._layout_checked = True
        self.deployer.log_info(str(report))
        return report

    # ----------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, store, epoch, position, config=None, examples_consumed=None,
                        stream_fingerprint=None):
        """Start saving the full training state to ``store`` (a :class:`CheckpointStore`);
        ``(epoch, position, examples_consumed)``: where a run resumed from it starts: ``position``
        updates and ``examples_consumed`` examples (in the epoch's order) into ``epoch``. Left
        None, ``examples_consumed`` is ``position`` updates of ``config``'s size where it has one.
        ``stream_fingerprint``: of a stream's consumed examples, for the resume to compare."""
        self._check_finite()
        meta = checkpoint_meta(self._progress, epoch, position, config, examples_consumed,
                               stream_fingerprint, fingerprint(self._state.frozen_params), to_host)
        store.save(self._progress.step, saved_part(self.state), meta)  # in the user's layout
        return meta

    def restore_checkpoint(self, store, per_update=None):
        """Load the newest complete checkpoint of ``store`` onto this mesh and continue from it
        (``trainer.progress``); its meta, or None. ``per_update``: this run's examples per update,
        for a checkpoint of the earlier format that recorded only updates."""
        abstract = jax.tree_util.tree_map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
            saved_part(self._state), saved_part(self.layout.state_shardings))
        restored = store.restore_latest_or_fail(abstract)
        if restored is None:
            return None
        arrays, meta = restored
        check_fingerprint(meta.get("frozen_params"), self._state.frozen_params,  # its base
                          where=f"The checkpoint {store.directory}/{meta['step']}")
        self._state = self.layout.stored.state_to_storage(self._state.replace(**arrays))
        self._opt_state_fresh = False
        self._progress = Progress.from_meta(
            meta, examples_trained(meta, per_update, self.deployer.log_warning),
            lambda key: jax.device_put(key, self.layout.replicated))
        return meta


def validate_callbacks(callbacks) -> list[Callback]:
    """``fit(callbacks=...)`` as a list of :class:`Callback` s (None: none)."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        callbacks = [callbacks]
    callbacks = list(callbacks)
    for callback in callbacks:
        if not isinstance(callback, Callback):
            raise ConfigError(f"fit(callbacks=...) holds {type(callback).__name__} "
                              f"({callback!r:.60}), which is no redcoast Callback. Fix: subclass "
                              "redcoast.Callback and override its hooks (after_step, "
                              "after_evaluation, after_epoch, at_end).")
    return callbacks


def _abstract(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


