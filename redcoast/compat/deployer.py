"""redco 0.4.23's Deployer methods and keywords on top of redcoast's Deployer."""

import json
import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from .. import deployer as core
from ..errors import ConfigError
from ..multihost import placement
from .checkpoints import read_info, restore_tree, save_redco_ckpt, saved_shapes
from .notices import warn_redco
from .rules import AutoShardingRules, plain_rules


class Deployer(core.Deployer):
    __doc__ = core.Deployer.__doc__ + """
    It also answers redco 0.4.23's methods and keywords (``get_accumulate_grad_batches``,
    ``load_ckpt``, ``save_ckpt``, ``log_info(info=...)``, ...); see README "Coming from redco".
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._redco_accumulation = {}  # per_device_batch_size -> k, from get_accumulate_grad_batches

    # ------------------------------------------------------------------ batch sizes, schedules

    def get_local_global_micro_batch_size(self, per_device_batch_size):
        """``(examples this process collates, examples in one global micro-batch)``."""
        global_size = self.global_batch_size(per_device_batch_size)
        return global_size // jax.process_count(), global_size

    process_batch_size = get_local_global_micro_batch_size  # the name in redco's newer examples

    def get_accumulate_grad_batches(self, global_batch_size, per_device_batch_size):
        """Micro-batches per optimizer update for ``global_batch_size`` examples per update."""
        micro = self.global_batch_size(per_device_batch_size)
        if global_batch_size % micro:
            raise ConfigError(
                f"global_batch_size={global_batch_size} is not a multiple of one micro-batch of "
                f"{micro} examples (per_device_batch_size={per_device_batch_size} x "
                f"{self.n_data_shards} data shards). Fix: make global_batch_size a multiple of {micro}.")
        k = global_batch_size // micro
        self._redco_accumulation[int(per_device_batch_size)] = k
        return k

    def get_lr_schedule_fn(self, train_size=None, per_device_batch_size=None, n_epochs=None,
                           learning_rate=None, schedule_type="linear", warmup_rate=0.0,
                           warmup_steps=None, init_learning_rate=0.0, end_learning_rate=0.0,
                           accumulate_grad_batches=None, warmup_ratio=None, max_steps=None):
        """As redcoast's; ``warmup_ratio`` is redco's name for ``warmup_rate``. Without
        ``accumulate_grad_batches``, the value ``get_accumulate_grad_batches`` returned for this
        ``per_device_batch_size`` is used, so the schedule counts optimizer updates."""
        if warmup_ratio is not None:
            warmup_rate = warmup_ratio
        if accumulate_grad_batches is None and per_device_batch_size is None:
            accumulate_grad_batches = 1
        if accumulate_grad_batches is None:
            accumulate_grad_batches = self._redco_accumulation.get(int(per_device_batch_size), 1)
            if accumulate_grad_batches > 1:
                warn_redco(
                    f"get_lr_schedule_fn: the schedule counts optimizer updates of "
                    f"{accumulate_grad_batches} micro-batches each (from get_accumulate_grad_batches)"
                    ", as redcoast's Trainer(accumulate_grad_batches=...) applies them; redco counted "
                    "micro-batches, so with optax.MultiSteps its schedule ended "
                    f"{accumulate_grad_batches}x too late. Pass accumulate_grad_batches= to say so.")
        return super().get_lr_schedule_fn(
            train_size, per_device_batch_size, n_epochs, learning_rate,
            schedule_type=schedule_type, warmup_rate=warmup_rate, warmup_steps=warmup_steps,
            init_learning_rate=init_learning_rate, end_learning_rate=end_learning_rate,
            accumulate_grad_batches=accumulate_grad_batches, max_steps=max_steps)

    # ------------------------------------------------------------------ sharding

    def get_sharding_plan(self, params, params_sharding_rules=None, **kwargs):
        return super().get_sharding_plan(params, plain_rules(params_sharding_rules, params), **kwargs)

    def get_sharding_rules(self, params=None, params_shape_or_params=None):
        """The automatic rules for ``params`` (redco: ``params_shape_or_params``). Passed back as
        ``params_sharding_rules`` they mean "automatic": the plan traced from the loss is used."""
        params = params_shape_or_params if params is None else params
        return AutoShardingRules(super().get_sharding_rules(params))

    def get_params_spec(self, params_shape_or_params, params_sharding_rules=None):
        """The PartitionSpec of every parameter (a tree like ``params``)."""
        return self.get_sharding_plan(params_shape_or_params, params_sharding_rules).param_specs

    def get_opt_state_spec(self, params_shape_or_params, params_spec, optimizer):
        del params_spec  # the plan places optimizer state by matching it to the parameters
        plan = self.get_sharding_plan(params_shape_or_params)
        opt_state = jax.eval_shape(optimizer.init, params_shape_or_params)
        return jax.tree_util.tree_map(lambda s: s.spec, plan.opt_state_shardings(opt_state))

    def shard_params(self, params, params_spec, desc="params"):
        """``params`` placed on the mesh by ``params_spec``."""
        del desc
        return placement.device_put(params, jax.tree_util.tree_map(
            lambda spec: NamedSharding(self.mesh, spec), params_spec,
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))

    # ------------------------------------------------------------------ random keys, steps

    def gen_model_step_rng(self):
        return self.gen_rng()

    def run_model_step(self, step_fn, input_args):
        return step_fn(*input_args)

    def get_model_input_batches(self, *args, **kwargs):
        raise ConfigError(
            "deployer.get_model_input_batches is redco's internal batching (every host collated the "
            "whole batch) and has no redcoast form. Fix: use trainer.train(examples, ...), "
            "trainer.eval_loss(...) or predictor.predict(...), which shard the batches themselves.")

    # ------------------------------------------------------------------ logging

    def log_info(self, text=None, title=None, step=None, info=None):
        """Log ``text`` (redco: ``info``), any value, under an optional ``title``."""
        del step
        super().log_info(str(info if text is None else text), title=title)

    def save_outputs(self, outputs, desc, step=None):
        """Write ``outputs`` (as strings) to ``workdir/outputs_{desc}.json`` on process 0."""
        del step
        if self.workdir is None or jax.process_index() != 0:
            return None
        path = os.path.join(self.workdir, f"outputs_{desc}.json")
        with open(path, "w") as f:
            json.dump(jax.tree_util.tree_map(str, outputs), f, indent=4)
        return path

    # ------------------------------------------------------------------ redco's checkpoints

    def save_ckpt(self, ckpt_dir, params, opt_state=None, float_dtype=None, **kwargs):
        """Save ``params`` (and ``opt_state``) in redco's layout; ``kwargs`` go to info.json."""
        info = dict(kwargs, rng=jax.device_get(self._rng).tolist())
        save_redco_ckpt(ckpt_dir, params, opt_state, float_dtype=float_dtype, info=info)
        self.log_info(f"saved a checkpoint in {os.path.abspath(ckpt_dir)}")

    def load_params_shape(self, ckpt_dir):
        return saved_shapes(os.path.join(os.path.abspath(ckpt_dir), "params"))

    def load_ckpt(self, ckpt_dir, params_sharding_rules=None, optimizer=None, float_dtype=None,
                  load_params=True, load_opt_state=True, update_rng=False):
        """``({'params': ..., 'opt_state': ...}, info)`` from a checkpoint in redco's layout,
        each array read straight into its shard of the automatic plan (or of the rules)."""
        ckpt_dir = os.path.abspath(ckpt_dir)
        abstract = self.load_params_shape(ckpt_dir)
        if float_dtype is not None:
            abstract = jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(a.shape, float_dtype)
                if jnp.issubdtype(a.dtype, jnp.floating) else a, abstract)
        plan = self.get_sharding_plan(abstract, params_sharding_rules)
        ckpt = {"params": None, "opt_state": None}
        if load_params:
            ckpt["params"] = restore_tree(os.path.join(ckpt_dir, "params"), abstract,
                                          plan.param_shardings(), float_dtype)
        if load_opt_state and os.path.isdir(os.path.join(ckpt_dir, "opt_state")):
            if optimizer is None:
                raise ConfigError(f"{ckpt_dir} holds an optimizer state: loading it needs the "
                                  "optimizer. Fix: pass optimizer=..., or load_opt_state=False.")
            abstract_opt = jax.eval_shape(optimizer.init, abstract)
            ckpt["opt_state"] = restore_tree(os.path.join(ckpt_dir, "opt_state"), abstract_opt,
                                             plan.opt_state_shardings(abstract_opt))
        info = read_info(ckpt_dir)
        if update_rng and "rng" in info:
            self._rng = info["rng"]
        self.log_info(f"loaded {ckpt_dir}")
        return ckpt, info

    def load_last_ckpt(self, optimizer=None, params_sharding_rules=None, float_dtype=None,
                       load_params=True, load_opt_state=True, update_rng=True):
        """The checkpoint named by redco's ``workdir/ckpts/last_ckpt.txt``, or ``(None, None)``."""
        marker = None if self.workdir is None else os.path.join(self.workdir, "ckpts", "last_ckpt.txt")
        if marker is None or not os.path.exists(marker):
            warn_redco(
                "load_last_ckpt found no redco checkpoint (workdir/ckpts/last_ckpt.txt) and returns "
                "(None, None). redcoast's Trainer.fit resumes by itself from its own checkpoints in "
                "workdir/checkpoints (mid-epoch, bitwise); nothing needs loading by hand.")
            return None, None
        with open(marker) as f:
            name = f.read().strip()
        return self.load_ckpt(os.path.join(self.workdir, "ckpts", name), params_sharding_rules,
                              optimizer, float_dtype, load_params, load_opt_state, update_rng)


__all__ = ["Deployer"]
