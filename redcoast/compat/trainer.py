"""redco 0.4.23's Trainer keywords, methods and custom steps on top of redcoast's Trainer."""

import inspect
import os

import jax
import jax.numpy as jnp

from .. import trainer as core, validate
from ..errors import ConfigError
from ..progress import Progress
from ..sharding.axes import DATA_AXIS
from .calls import COLLATE_FN_ARGS, EVAL_METRIC_FN_ARGS, LOSS_FN_ARGS, by_keyword
from .notices import warn_redco
from .optimizers import params_for_optimizer, unwrap_multisteps
from .predictor import Predictor
from .rules import plain_rules

REDCO_STEP_KEYWORDS = ("loss_fn", "lr_schedule_fn", "mesh", "compute_dtype")


def adapt_train_step_fn(train_step_fn, trainer, loss_fn, lr_schedule_fn, compute_dtype):
    """``train_step_fn`` as redcoast calls it, ``(state, batch, rng) -> (state, metrics)``.

    redco's form ``(rng, state, batch, loss_fn, lr_schedule_fn, mesh, compute_dtype)`` is
    called as redco did: the batch split into a leading axis of data shards (redco vmapped over
    ``mesh.shape['dp']``), ``loss_fn`` the user's own (called by keyword).
    """
    if train_step_fn is None:
        return None
    try:
        names = list(inspect.signature(train_step_fn).parameters)
    except (TypeError, ValueError):
        return train_step_fn
    if not any(n in names for n in REDCO_STEP_KEYWORDS):
        try:
            inspect.signature(train_step_fn).bind(None, None, None)
        except TypeError as e:
            raise ConfigError(
                f"train_step_fn{inspect.signature(train_step_fn)} cannot be called as redcoast's "
                "train_step_fn(state, batch, rng) -> (new_state, metrics) nor as redco's "
                "train_step_fn(rng, state, batch, loss_fn, lr_schedule_fn, mesh, compute_dtype). "
                "Fix: give it one of those signatures.") from e
        return train_step_fn
    if trainer.accumulate_grad_batches > 1:
        raise ConfigError(
            "A redco-style train_step_fn(rng, state, batch, loss_fn, ...) takes one micro-batch, "
            f"but accumulate_grad_batches={trainer.accumulate_grad_batches}. Fix: "
            "accumulate_grad_batches=1, or write redcoast's train_step_fn(state, batch, rng) for "
            "a batch with a leading axis of micro-batches.")

    def step(state, batch, rng):
        mesh = trainer.deployer.mesh
        dp = mesh.shape[DATA_AXIS]
        by_shard = jax.tree_util.tree_map(lambda x: x.reshape((dp, -1) + x.shape[1:]), batch)
        return train_step_fn(jax.random.fold_in(rng, state.step), state, by_shard, loss_fn=loss_fn,
                             lr_schedule_fn=lr_schedule_fn, mesh=mesh, compute_dtype=compute_dtype)

    return step


class Trainer(core.Trainer):
    __doc__ = core.Trainer.__doc__ + """
    It also takes redco 0.4.23's keywords (``opt_state``, ``params_sharded``,
    ``opt_state_sharded``, ``last_ckpt_info``, ``accumulate_grad_batches=None``, an
    ``optax.MultiSteps`` optimizer, redco's ``train_step_fn``) and methods
    (``set_train_state``, ``get_params_to_save``, ``save_ckpt``); see README "Coming from redco".
    """

    def __init__(self, deployer, collate_fn, apply_fn, loss_fn, params, optimizer, opt_state=None,
                 params_sharded=False, opt_state_sharded=False, compute_dtype=jnp.float32,
                 last_ckpt_info=None, lr_schedule_fn=None, accumulate_grad_batches=None,
                 params_sharding_rules=None, train_step_fn=None, **kwargs):
        del params_sharded, opt_state_sharded  # redcoast places whatever it is given
        # the core's checks first: the adaptations below call the functions and the optimizer
        validate.trainer_args(collate_fn, loss_fn, optimizer, train_step_fn)
        k = 1 if accumulate_grad_batches is None else accumulate_grad_batches
        params = params_for_optimizer(optimizer, params)
        optimizer, opt_state = unwrap_multisteps(optimizer, opt_state, k, params)
        self.accumulate_grad_batches = k  # read by adapt_train_step_fn before the core sets it
        loss_fn = by_keyword(loss_fn, LOSS_FN_ARGS, copy_batch=True)
        step_fn = adapt_train_step_fn(train_step_fn, self, loss_fn, lr_schedule_fn, compute_dtype)
        params_sharding_rules = plain_rules(params_sharding_rules, params)
        super().__init__(deployer, by_keyword(collate_fn, COLLATE_FN_ARGS), apply_fn, loss_fn,
                         params, optimizer, lr_schedule_fn=lr_schedule_fn,
                         accumulate_grad_batches=k, params_sharding_rules=params_sharding_rules,
                         compute_dtype=compute_dtype, train_step_fn=step_fn, **kwargs)
        # redco's last_ckpt_info: the step reached and the last epoch done
        progress = None if not last_ckpt_info else Progress(
            step=int(last_ckpt_info.get("step", 0)),
            epoch=int(last_ckpt_info.get("epoch_idx", -1)) + 1)
        self.restart(progress=progress, opt_state=opt_state)

    # ------------------------------------------------------------------ redco's methods

    def set_train_state(self, apply_fn, optimizer, step, params, opt_state=None,
                        params_sharded=False, opt_state_sharded=False):
        """Start again from ``params`` with ``optimizer`` at ``step`` (e.g. one FedAvg client)."""
        del params_sharded, opt_state_sharded
        params = params_for_optimizer(optimizer, params)
        optimizer, opt_state = unwrap_multisteps(optimizer, opt_state, self.accumulate_grad_batches,
                                                 params)
        self.restart(Progress(step=int(step)), params=params, opt_state=opt_state,
                     optimizer=optimizer, apply_fn=apply_fn)

    def get_params_to_save(self, state_params=None):
        """The parameters (or ``state_params``), as global arrays: save them as they are."""
        return self.params if state_params is None else state_params

    def save_ckpt(self, epoch_idx, ckpt_name, save_opt_state=True, float_dtype=None):
        """Save in redco's layout under ``workdir/ckpts/{ckpt_name}`` (for redco's tools;
        ``fit`` resumes from redcoast's own checkpoints)."""
        if self.deployer.workdir is None:
            raise ConfigError("save_ckpt needs a workdir. Fix: pass workdir=... to Deployer.")
        ckpts = os.path.join(self.deployer.workdir, "ckpts")
        self.deployer.save_ckpt(
            os.path.join(ckpts, ckpt_name), self.params,
            opt_state=self.state.opt_state if save_opt_state else None, float_dtype=float_dtype,
            step=self.step, epoch_idx=epoch_idx)
        if jax.process_index() == 0:
            with open(os.path.join(ckpts, "last_ckpt.txt"), "w") as f:
                f.write(ckpt_name)

    def get_default_predictor(self, pred_fn, output_fn=None):
        return Predictor(self.deployer, self.collate_fn, pred_fn, output_fn=output_fn)

    @property
    def workdir(self):
        return self.deployer.workdir

    # ------------------------------------------------------------------ fit

    def fit(self, train_examples, per_device_batch_size, n_epochs, eval_examples=None,
            eval_per_device_batch_size=None, eval_loss=True, eval_predictor=None,
            eval_metric_fn=None, eval_sanity_check=False, save_ckpt_every_k_epochs=None,
            save_opt_states=True, save_float_dtype=None, **kwargs):
        """As redcoast's ``fit``; also takes redco's ``save_ckpt_every_k_epochs`` (=
        ``save_every_k_epochs``), ``save_opt_states``, ``save_float_dtype`` and
        ``eval_sanity_check`` (evaluate and predict one batch before training)."""
        if save_ckpt_every_k_epochs is not None:
            if kwargs.get("save_every_k_epochs") is not None:
                raise TypeError("fit() got both save_ckpt_every_k_epochs (redco's name) and "
                                "save_every_k_epochs.")
            kwargs["save_every_k_epochs"] = save_ckpt_every_k_epochs
        if not save_opt_states:
            warn_redco("fit(save_opt_states=False): redcoast's checkpoints always hold the optimizer "
                       "state, which an exact resume needs. For the parameters alone use "
                       "deployer.export_params(trainer.params, path).")
        if save_float_dtype is not None:
            dtype = jnp.dtype(save_float_dtype).name
            warn_redco(f"fit(save_float_dtype={dtype}): redcoast's checkpoints keep the "
                       "training dtype, which an exact resume needs. For a smaller copy of the "
                       "parameters cast them and use deployer.export_params(params, path).")
        eval_metric_fn = by_keyword(eval_metric_fn, EVAL_METRIC_FN_ARGS)
        train_examples = _epoch_idx_as_keyword(train_examples)
        eval_bs = eval_per_device_batch_size or per_device_batch_size
        validate.eval_examples_sequence(eval_examples)  # before the sanity check reads it
        if eval_sanity_check and eval_examples is not None:
            self._sanity_check(eval_examples, eval_bs, eval_loss, eval_predictor, eval_metric_fn)
        return super().fit(train_examples, per_device_batch_size, n_epochs,
                           eval_examples=eval_examples, eval_per_device_batch_size=eval_bs,
                           eval_loss=eval_loss, eval_predictor=eval_predictor,
                           eval_metric_fn=eval_metric_fn, **kwargs)

    def _sanity_check(self, eval_examples, eval_bs, eval_loss, eval_predictor, eval_metric_fn):
        """redco's check: the evaluation runs on one batch before hours of training."""
        few = [eval_examples[i] for i in range(min(len(eval_examples),
                                                   self.deployer.global_batch_size(eval_bs)))]
        if eval_loss:
            self.eval_loss(few, eval_bs)
        if eval_predictor is not None:
            preds = eval_predictor.predict(few, eval_bs, params=self.params)
            if eval_metric_fn is not None:
                eval_metric_fn(few, preds)
        self.deployer.log_info("sanity check of the evaluation passed")


def _epoch_idx_as_keyword(train_examples):
    """A function of the epoch that names ``epoch_idx`` is called as redco called it,
    ``train_examples(epoch_idx=epoch)``; anything else as redcoast calls it."""
    if not callable(train_examples) or hasattr(train_examples, "__getitem__"):
        return train_examples
    try:
        names = inspect.signature(train_examples).parameters
    except (TypeError, ValueError):
        return train_examples
    if "epoch_idx" not in names:
        return train_examples
    return lambda epoch: train_examples(epoch_idx=epoch)


__all__ = ["Trainer"]
