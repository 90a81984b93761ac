"""The training loop around one jitted, sharded step."""

import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from .checkpoint import save_params
from .data import BatchMaker, epoch_order, padded_batches, prefetch
from .errors import ConfigError, NonFiniteLossError
from .host import to_host
from .predictor import Predictor
from .steps import make_eval_step, make_train_step
from .train_state import TrainState


class Trainer:
    """Trains ``params`` with ``loss_fn`` on the deployer's mesh.

    ``loss_fn(rng, state, params, batch, is_training)`` returns a scalar loss or
    ``(loss, {name: scalar})``; ``params`` arrive in ``compute_dtype``. Parameter placement comes
    from ``params_sharding_rules`` (the paper's format) where given, automatic rules elsewhere.
    ``train_step_fn(state, batch, rng) -> (state, metrics)`` replaces the built-in step.
    """

    def __init__(self, deployer, collate_fn, apply_fn, loss_fn, params, optimizer,
                 lr_schedule_fn=None, accumulate_grad_batches=1, params_sharding_rules=None,
                 compute_dtype=jnp.float32, train_step_fn=None):
        if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
            raise ConfigError(f"accumulate_grad_batches={accumulate_grad_batches!r}; it must be a "
                              "positive integer.")
        self.deployer = deployer
        self.collate_fn = collate_fn
        self.loss_fn = loss_fn
        self.lr_schedule_fn = lr_schedule_fn
        self.accumulate_grad_batches = accumulate_grad_batches
        self.compute_dtype = compute_dtype
        mesh = deployer.mesh
        self._replicated = NamedSharding(mesh, P())

        self.plan = deployer.get_sharding_plan(params, params_sharding_rules)
        if deployer.verbose:
            deployer.log_info(self.plan.table(), title="Sharding plan")
            deployer.log_info(self.plan.rules_source(), title="As params_sharding_rules:")
        param_shardings = self.plan.param_shardings()
        # The step donates its state, which must never delete the caller's arrays, and
        # device_put may reuse their buffers: a compiled copy owns fresh ones.
        params = jax.jit(lambda p: jax.tree_util.tree_map(jnp.copy, p), out_shardings=param_shardings)(
            jax.device_put(params, param_shardings))
        opt_shardings = self.plan.opt_state_shardings(jax.eval_shape(optimizer.init, params))
        opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
        scalar = lambda v: jax.device_put(jnp.asarray(v, jnp.int32), self._replicated)
        self._state = TrainState(step=scalar(0), params=params, opt_state=opt_state,
                                 nonfinite_step=scalar(-1), apply_fn=apply_fn, tx=optimizer)
        self._state_shardings = TrainState(
            step=self._replicated, params=param_shardings, opt_state=opt_shardings,
            nonfinite_step=self._replicated, apply_fn=apply_fn, tx=optimizer)
        self._host_step = 0
        self._train_rng = jax.device_put(deployer.gen_rng(), self._replicated)
        self._eval_rng = jax.device_put(deployer.gen_rng(), self._replicated)
        self._best = {}

        step_fn = train_step_fn or make_train_step(
            loss_fn, compute_dtype, accumulate_grad_batches, grad_shardings=param_shardings)
        batch_spec = P("dp") if accumulate_grad_batches == 1 else P(None, "dp")
        self._train_step = jax.jit(
            step_fn,
            in_shardings=(self._state_shardings, NamedSharding(mesh, batch_spec), self._replicated),
            out_shardings=(self._state_shardings, self._replicated),
            donate_argnums=(0,))
        self._eval_step = jax.jit(
            make_eval_step(loss_fn, compute_dtype),
            in_shardings=(self._state_shardings, NamedSharding(mesh, P("dp")),
                          NamedSharding(mesh, P("dp")), self._replicated),
            out_shardings=self._replicated)

    @property
    def state(self):
        return self._state

    @property
    def params(self):
        return self._state.params

    @property
    def step(self):
        """Optimizer updates applied so far."""
        return self._host_step

    def get_default_predictor(self, pred_fn, output_fn=None):
        """A :class:`Predictor` sharing this trainer's collate_fn and parameter placement."""
        return Predictor(self.deployer, self.collate_fn, pred_fn, output_fn=output_fn,
                         params_sharding_rules=self.plan.rules())

    def train(self, examples, per_device_batch_size, desc=None, shuffle=True, epoch=0,
              log_every_n_steps=10):
        """One pass over ``examples`` (shuffled from the seed and ``epoch``); the last
        incomplete batch is dropped."""
        k = self.accumulate_grad_batches
        global_batch = self.deployer.global_batch_size(per_device_batch_size)
        per_update = global_batch * k
        n_steps = len(examples) // per_update
        if n_steps == 0:
            raise ConfigError(
                f"{len(examples)} training examples do not fill one update of {per_update} "
                f"(per_device_batch_size={per_device_batch_size} x {self.deployer.n_data_shards} "
                f"data shards x accumulate_grad_batches={k}). Fix: use a smaller batch size.")
        order = epoch_order(len(examples), self.deployer.jax_seed, epoch, shuffle)
        maker = BatchMaker(self.deployer.mesh, self.collate_fn, global_batch, micro_batches=k)
        batches = prefetch(maker.make(examples, order[i * per_update:(i + 1) * per_update])
                           for i in range(n_steps))
        bar = tqdm(total=n_steps, desc=desc or "train", dynamic_ncols=True,
                   disable=not (self.deployer.verbose and jax.process_index() == 0))
        pending, timed, since = [], 0, time.perf_counter()
        try:
            for i, batch in enumerate(batches):
                self._state, metrics = self._train_step(self._state, batch, self._train_rng)
                self._host_step += 1
                pending.append(metrics)
                if i == 0:  # the first call compiles: time throughput from its end
                    since = time.perf_counter()
                else:
                    timed += 1
                if len(pending) == log_every_n_steps or i + 1 == n_steps:
                    elapsed = time.perf_counter() - since
                    rate = timed * per_update / elapsed if timed and elapsed > 0 else None
                    self._log_train(pending, rate, bar)
                    pending, timed, since = [], 0, time.perf_counter()
                bar.update(1)
        finally:
            bar.close()

    def _log_train(self, pending, examples_per_s, bar):
        """Pull the metrics of the last few steps (one host sync), check them, log them."""
        history, bad_step = to_host((pending, self._state.nonfinite_step))
        if bad_step >= 0:
            raise NonFiniteLossError(
                f"The training loss became {_describe_nonfinite(history)} at step {int(bad_step)} "
                f"(counting from 0). That update and every later one were not applied, so "
                f"trainer.state holds the parameters from before step {int(bad_step)}, and no "
                "checkpoint was written. Fix: lower the learning rate, add warmup or gradient "
                "clipping (optax.clip_by_global_norm), or check that batch for bad values.")
        means = {k: float(np.mean([m[k] for m in history])) for k in history[-1]}
        if self.lr_schedule_fn is not None:
            means["lr"] = float(self.lr_schedule_fn(self._host_step - 1))
        if examples_per_s is not None:  # unknown when the window held only the compiling step
            means["examples_per_s"] = examples_per_s
        bar.set_postfix({k: f"{v:.4g}" for k, v in means.items()}, refresh=False)
        self.deployer.log_metrics({f"train_{k}": v for k, v in means.items()}, self._host_step)

    def _evaluate(self, examples, per_device_batch_size, desc=None):
        """Means over examples of the loss and metrics, every example counted exactly once."""
        global_batch = self.deployer.global_batch_size(per_device_batch_size)
        maker = BatchMaker(self.deployer.mesh, self.collate_fn, global_batch)
        batches = prefetch((maker.make(examples, idx), maker.padding_mask(n_real))
                           for idx, n_real in padded_batches(len(examples), global_batch))
        totals, count = None, 0.0
        for batch, mask in batches:
            sums, n = self._eval_step(self._state, batch, mask, self._eval_rng)
            totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
            count = count + n
        totals, count = to_host((totals, count))
        return {k: float(v) / float(count) for k, v in totals.items()}

    def eval_loss(self, examples, per_device_batch_size, desc=None):
        """The mean loss over ``examples`` (loss_fn called with ``is_training=False``)."""
        return self._evaluate(examples, per_device_batch_size, desc=desc)["loss"]

    def save_params(self, path):
        """Write the current parameters as a safetensors file (readable without redcoast)."""
        save_params(self._state.params, path)

    def fit(self, train_examples, per_device_batch_size, n_epochs, eval_examples=None,
            eval_per_device_batch_size=None, eval_loss=True, eval_predictor=None,
            eval_metric_fn=None, save_last_ckpt=False, save_argmin_ckpt_by_metrics=None,
            save_argmax_ckpt_by_metrics=None, log_every_n_steps=10, shuffle=True):
        """Train for ``n_epochs``, evaluating (and saving, if asked) after each epoch.

        ``eval_metric_fn(eval_examples, predictions) -> dict`` scores ``eval_predictor``'s
        predictions; ``save_argmin/argmax_ckpt_by_metrics`` name eval results ('loss' or keys
        of that dict) whose best value so far is kept as a checkpoint under ``workdir/ckpts``.
        """
        save_min = list(save_argmin_ckpt_by_metrics or [])
        save_max = list(save_argmax_ckpt_by_metrics or [])
        if (save_last_ckpt or save_min or save_max) and self.deployer.workdir is None:
            raise ConfigError("Saving checkpoints needs a workdir. Fix: pass workdir=... to Deployer.")
        eval_bs = eval_per_device_batch_size or per_device_batch_size
        for epoch in range(n_epochs):
            self.train(train_examples, per_device_batch_size, epoch=epoch, shuffle=shuffle,
                       desc=f"epoch {epoch + 1}/{n_epochs}", log_every_n_steps=log_every_n_steps)
            results = {}
            if eval_examples is not None:
                if eval_loss:
                    results.update(self._evaluate(eval_examples, eval_bs))
                if eval_predictor is not None:
                    preds = eval_predictor.predict(eval_examples, eval_bs, params=self.params)
                    if eval_metric_fn is not None:
                        results.update(eval_metric_fn(eval_examples, preds))
            if results:
                shown = ", ".join(f"{k} = {v:.4f}" if isinstance(v, float) else f"{k} = {v}"
                                  for k, v in results.items())
                self.deployer.log_info(f"epoch {epoch + 1}/{n_epochs}: eval {shown}")
                self.deployer.log_metrics({f"eval_{k}": v for k, v in results.items()}, self._host_step)
            self._save_checkpoints(results, epoch, save_last_ckpt, save_min, save_max)

    def _save_checkpoints(self, results, epoch, save_last, save_min, save_max):
        ckpt_dir = os.path.join(self.deployer.workdir or "", "ckpts")
        for name, better in [(m, min) for m in save_min] + [(m, max) for m in save_max]:
            if name not in results:
                raise ConfigError(f"Cannot keep the best checkpoint by '{name}': the evaluation "
                                  f"gave {sorted(results)}. Fix: name one of those.")
            value = float(results[name])
            tag = f"{better.__name__}_{name}"
            if not math.isnan(value) and (tag not in self._best or better(value, self._best[tag]) == value
                                          and value != self._best[tag]):
                self._best[tag] = value
                self.save_params(os.path.join(ckpt_dir, tag, "params.safetensors"))
                self.deployer.log_info(f"saved best checkpoint by {name} = {value:.4f} (epoch {epoch + 1})")
        if save_last:
            self.save_params(os.path.join(ckpt_dir, "last", "params.safetensors"))


def _describe_nonfinite(history):
    losses = [float(m["loss"]) for m in history]
    bad = [x for x in losses if not math.isfinite(x)]
    return str(bad[0]) if bad else "NaN or inf"
