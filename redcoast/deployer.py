"""One run's environment: processes, device mesh, random streams, schedules, logging."""

import os
import weakref

import jax
import numpy as np
from jax.sharding import AxisType

from . import validate
from .data import global_batch_size
from .errors import ConfigError
from .export import save_params
from .layout.cost_model import link_costs
from .logs import RunLogger
from .multihost import distributed
from .schedules import make_lr_schedule, n_updates_per_epoch
from .sharding import ShardingPlan
from .sharding.axes import DATA_AXIS, MESH_AXES, MODEL_AXIS
from .sharding.dataflow import traced_placements
from .store import user_cache
from .store.workdir import WorkdirLock, absolute


class Deployer:
    """Owns the devices of a run and everything that is the same for all its parts.

    The mesh has axes ``('dp', 'mp')``: ``mp`` = ``n_model_shards`` devices hold one copy of the
    model between them; ``dp`` = devices / n_model_shards copies each see their own slice of
    every batch. With ``n_model_shards='auto'`` this mesh spreads the model over every device,
    and each Trainer chooses its own number at its first batch (``trainer.layout``); the
    deployer is never changed by what a Trainer chooses.

    ``devices``: the devices to lay the mesh over (default ``jax.devices()``); a compile-only
    target's, such as a TPU pod described by ``jax.experimental.topologies``, lets a Trainer
    built from abstract parameters compile its step for hardware that is not here
    (``redcoast plan --target``).
    """

    def __init__(self, jax_seed=0, n_model_shards=1, workdir=None, verbose=True,
                 run_tensorboard=False, wandb_init_kwargs=None, n_processes=None,
                 host0_address=None, host0_port=None, process_id=None, n_local_devices=None,
                 memory_budget_bytes=None, devices=None):
        # before the first compilation of the run: its steps are then kept between runs
        self.compilation_cache_dir, cache_note = user_cache.enable_compilation_cache()
        self.cluster = distributed.initialize(
            n_processes=n_processes, host0_address=host0_address, host0_port=host0_port,
            process_id=process_id, n_local_devices=n_local_devices)
        # Every device of the run by default. A compile-only target's devices (a TPU pod's
        # from jax.experimental.topologies, with no chips here) plan and compile, never run.
        self.devices = list(jax.devices() if devices is None else devices)
        self.jax_seed = int(jax_seed)
        # absolute once, here: a later os.chdir (a notebook's %cd) must not move the run's files
        self.workdir = workdir = None if workdir is None else absolute(workdir)
        self.verbose = verbose
        if isinstance(n_model_shards, str):
            if n_model_shards != "auto":
                raise ConfigError(f"n_model_shards={n_model_shards!r}; it must be a positive integer "
                                  "or 'auto'.")
            # A Trainer chooses the number among its layouts at the first batch (layout.py);
            # until then, and for what runs outside a Trainer, the model is spread over every
            # device: whatever the model, its placement then fits if anything does.
            self.n_model_shards_requested = "auto"
            n_model_shards = len(self.devices)
        else:
            self.n_model_shards_requested = n_model_shards
        self.memory_budget_bytes = memory_budget_bytes
        self.mesh = make_mesh(n_model_shards, self.devices)
        self._rng = jax.random.PRNGKey(self.jax_seed)
        if workdir is not None:  # before a line goes into another live run's logs
            WorkdirLock(workdir).refuse_if_in_use()
        self.logger = RunLogger(workdir=workdir, verbose=verbose, run_tensorboard=run_tensorboard,
                                wandb_init_kwargs=wandb_init_kwargs)
        # the log files and TensorBoard writer are closed (their last records written) by
        # close(), at the end of a `with Deployer(...)` block, or at the latest at exit
        self._close_logger = weakref.finalize(self, self.logger.close)
        self.log_info(
            f"{len(self.devices)} {self.platform} devices in {jax.process_count()} "
            f"process(es) ({distributed.describe(self.cluster)}); "
            f"mesh dp={self.n_data_shards} x mp={self.n_model_shards}"
            + (" (n_model_shards='auto': a Trainer chooses its own at the first batch)"
               if self.n_model_shards_requested == "auto" else ""))
        self.log_info(cache_note)

    def close(self):
        """Flush and close the run's logs (log.txt, metrics.jsonl, TensorBoard, W&B)."""
        self._close_logger()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def model_shard_candidates(self):
        """Every valid n_model_shards on these devices, smallest first."""
        n = len(self.devices)
        return [d for d in range(1, n + 1) if n % d == 0]

    def mesh_for(self, n_model_shards):
        """The ('dp', 'mp') mesh with ``n_model_shards`` over this run's devices (the deployer's
        own mesh for its own number)."""
        if n_model_shards == self.n_model_shards:
            return self.mesh
        return make_mesh(n_model_shards, self.devices)

    def device_memory_budget(self):
        """Bytes one device may use: ``memory_budget_bytes`` if given, else the accelerator's
        limit, else (CPU) the host's memory shared by its local devices."""
        if self.memory_budget_bytes:
            return int(self.memory_budget_bytes)
        try:
            stats = jax.local_devices(backend=self.platform)[0].memory_stats() or {}
        except Exception:  # noqa: BLE001 - some backends do not report
            stats = {}
        if stats.get("bytes_limit"):
            return int(stats["bytes_limit"])
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return host // jax.local_device_count()

    @property
    def platform(self):
        """The run's devices' platform: 'cpu', 'gpu' or 'tpu'."""
        return self.devices[0].platform

    @property
    def n_model_shards(self):
        return self.mesh.shape[MODEL_AXIS]

    @property
    def n_data_shards(self):
        return self.mesh.shape[DATA_AXIS]

    @property
    def process_index(self):
        return jax.process_index()

    @property
    def n_processes(self):
        return jax.process_count()

    def global_batch_size(self, per_device_batch_size):
        """Examples per micro-batch across the whole mesh: one slice per data-parallel shard."""
        return global_batch_size(validate.positive_int("per_device_batch_size", per_device_batch_size),
                                 self.mesh)

    def gen_rng(self):
        """A fresh PRNG key; the sequence depends on ``jax_seed`` only (same on every process)."""
        self._rng, rng = jax.random.split(self._rng)
        return rng

    def get_lr_schedule_fn(self, train_size=None, per_device_batch_size=None, n_epochs=None,
                           learning_rate=None, schedule_type="linear", warmup_rate=0.0,
                           warmup_steps=None, init_learning_rate=0.0, end_learning_rate=0.0,
                           accumulate_grad_batches=1, max_steps=None):
        """An optax schedule over the run's optimizer updates (not its micro-batches): as many
        as ``n_epochs`` of ``train_size`` examples give, or ``max_steps`` (as ``fit``'s: the
        fewer of the two when both are known; ``max_steps`` alone for a stream of unknown size)."""
        if learning_rate is None:
            raise ConfigError("get_lr_schedule_fn needs learning_rate=... (the peak rate).")
        if max_steps is not None and (train_size is None or n_epochs is None):
            total = int(max_steps)
        elif train_size is None or per_device_batch_size is None or n_epochs is None:
            raise ConfigError(
                "get_lr_schedule_fn needs the run's length: train_size, per_device_batch_size and "
                "n_epochs, or max_steps (the updates fit(max_steps=...) trains for). Fix: pass "
                "max_steps=... when the examples are a stream of unknown size.")
        else:
            per_epoch = n_updates_per_epoch(train_size, self.global_batch_size(per_device_batch_size),
                                            accumulate_grad_batches)
            total = per_epoch * int(n_epochs)
            if max_steps is not None:
                total = min(total, int(max_steps))
        if warmup_steps is None:
            warmup_steps = int(round(warmup_rate * total))
        return make_lr_schedule(total, learning_rate, schedule_type=schedule_type,
                                warmup_steps=warmup_steps, init_learning_rate=init_learning_rate,
                                end_learning_rate=end_learning_rate)

    def get_sharding_plan(self, params, params_sharding_rules=None, base_placements=None,
                          fsdp=False, traced_fn=None, example_args=()):
        """The placement of every parameter on this mesh (printable with ``.table()``);
        ``fsdp=True`` also splits large tensors over 'dp' (ZeRO-3), as the Trainer does.

        With ``traced_fn`` (``traced_fn(params, *example_args)``, e.g. a forward pass on
        ``jax.ShapeDtypeStruct`` inputs) the plan follows its data flow; without, or when it
        cannot be traced, the plan comes from shapes and order alone."""
        if base_placements is None and traced_fn is not None:
            base_placements, source = traced_placements(traced_fn, params, *example_args,
                                                        n_model_shards=self.n_model_shards,
                                                        link_costs=link_costs(self.mesh))
            if base_placements is None:
                self.log_warning(f"sharding from {source}")
        return ShardingPlan(params, self.mesh, user_rules=params_sharding_rules,
                            base_placements=base_placements, fsdp=fsdp)

    def get_sharding_rules(self, params):
        """Automatic rules for ``params`` in the paper's format: [(tuple of regexes, PartitionSpec)]."""
        return self.get_sharding_plan(params).rules()

    def export_params(self, params, path):
        """Write ``params`` as one safetensors file: tensor name ('a.b.kernel') -> array."""
        save_params(params, path)

    def log_info(self, text, title=None):
        self.logger.info(text, title=title)

    def log_warning(self, text):
        self.logger.warning(text)

    def log_metrics(self, metrics, step):
        self.logger.metrics(metrics, step)


def make_mesh(n_model_shards, devices=None):
    """A ('dp', 'mp') mesh over all devices, or a clear error when the shards do not divide them."""
    devices = jax.devices() if devices is None else devices
    n = len(devices)
    if not isinstance(n_model_shards, (int, np.integer)) or n_model_shards < 1:
        raise ConfigError(f"n_model_shards={n_model_shards!r}; it must be a positive integer.")
    if n % n_model_shards:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise ConfigError(
            f"n_model_shards={n_model_shards} does not divide the {n} available devices. Fix: use "
            f"one of {divisors}, or run on a number of devices that {n_model_shards} divides.")
    return jax.make_mesh((n // n_model_shards, n_model_shards), MESH_AXES,
                         axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)
