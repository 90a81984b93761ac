"""``redcoast plan``: will this model train on that hardware, in what layout, with what memory?

A run is planned without its hardware and without its weights: the model is built from its
Hugging Face config.json alone (abstract parameters, nothing allocated), a Trainer chooses its
layout as it would for the real run, and the training step is compiled for the target's number
of devices: by the target's own compiler where it runs here without the hardware (TPU v4
through libtpu and ``jax.experimental.topologies``: ``--target tpu-v4``; NVIDIA GPUs through
JAX's CUDA plugin and a description of the GPU, redcoast/cli/gpu_targets.py: ``--target h100``,
``h200``, ``a100``, ``a100-40gb``), else simulated on this machine's CPU (XLA:CPU's buffer
assignment stands in for the target compiler's); the record says which. A compiler that
refuses the step for memory gives the verdict too (DOES NOT FIT, with what it asked for). The
per-device memory is split into what the layout holds (parameters, optimizer state, gradients)
and the compiler's temporaries; the peak is the compiler's.

The layout is searched as a user would choose it (plan_search.py): the number of model shards,
remat on or off, layers scanned or unrolled, ranked by an estimated step time and compiled in
that order until one fits; the record keeps every layout searched and why each lost. Flags pin
a choice. When nothing fits, what would is computed: how many devices, bfloat16, Adafactor, the
longest sequence.

    redcoast plan path/to/config.json --devices 4 --device-memory 40GiB --seq-len 1024
"""

import argparse
import dataclasses
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

from ..errors import CompileFailure, PlanError
from . import gpu_targets, plan_search

SEQ2SEQ = ("t5", "bart")
CAUSAL = ("llama", "mistral", "qwen2", "gpt2", "gptj", "opt")
# families redcoast builds whose training the plan's token-sequence loss does not stand for
NOT_PLANNED = {"bert": "an encoder (its loss reads no next tokens)",
               "vit": "an image model (its inputs are pixels, not tokens)",
               "vision-encoder-decoder": "an image-to-text model (its inputs are pixels)"}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclasses.dataclass
class PlanRecord:
    """What :func:`plan` found (JSON-ready): the layout, its memory per device, whether it fits."""
    config: str
    model_type: str
    n_params: int
    devices: int
    hosts: int
    device_memory_bytes: int
    seq_len: int
    per_device_batch_size: int
    param_dtype: str
    optimizer: str
    remat: bool
    layout: str
    params_bytes: int            # per device, as the layout stores them
    optimizer_bytes: int         # per device
    gradient_bytes: int          # per device, as reduced (the parameters' placement)
    temporary_bytes: int         # the compiler's temporaries (activations, gradients in flight)
    per_device_peak_bytes: int   # arguments + outputs - donated + temporaries
    fits: bool
    flops_per_device: float
    compile_seconds: float
    compiler: str
    host_memory_bytes: int = 0   # this planning process's peak resident memory
    scan_layers: bool = False    # the layers stacked and run by a scan (one traced layer)
    tried: list = dataclasses.field(default_factory=list)   # other compiles: (what, peak)
    suggestions: list = dataclasses.field(default_factory=list)
    examples_per_step: int = 0        # the global batch: per-device batch x data shards
    est_step_seconds: float = 0.0     # plan_search's estimate, not a measurement
    est_mfu: float | None = None      # model FLOPs over the estimated time and the peak
    estimate_basis: str = ""          # the peak and links the estimate assumed, with sources
    candidates: list = dataclasses.field(default_factory=list)  # every layout searched (dicts)
    attention: str = ""               # the planned step's attention where not the model's own
    megatron_share: float = 1.0       # parameters per device over Megatron's split's
    short_of_megatron: str = ""       # the weights kept whole and why, when over 1.25x
    megatron_bytes: float | None = None  # the step's bytes between model shards over Megatron's
    bytes_short_of_megatron: str = ""    # what the step moves more, when over 1.25x

    def table(self):
        """The record as the CLI prints it."""
        gib = lambda n: f"{n / 2**30:8.2f} GiB"  # noqa: E731
        rows = [("model", f"{self.model_type}, {self.n_params / 1e9:.2f} B parameters "
                          f"({self.config})"),
                ("target", f"{self.devices} devices on {self.hosts} host(s), "
                           f"{self.device_memory_bytes / 2**30:.1f} GiB each"),
                ("run", f"seq {self.seq_len}, {self.per_device_batch_size} per data shard, "
                        f"{self.param_dtype} parameters, {self.optimizer}"
                        + (", each layer rematerialised" if self.remat else "")
                        + (", layers scanned" if self.scan_layers else "")
                        + (f", attention {self.attention}" if self.attention else "")),
                ("layout", self.layout),
                ("vs Megatron", f"{self.megatron_share:.2f}x its parameters per device"
                                + (" (see the warning)" if self.short_of_megatron else "")
                                + ("" if self.megatron_bytes is None else
                                   f", {self.megatron_bytes:.2f}x its bytes between model shards"
                                   + (" (see the warning)" if self.bytes_short_of_megatron
                                      else ""))),
                ("parameters", gib(self.params_bytes)),
                ("optimizer state", gib(self.optimizer_bytes)),
                ("gradients", gib(self.gradient_bytes)),
                ("temporaries", gib(self.temporary_bytes) + "  (compiler; activations included)"),
                ("peak per device", gib(self.per_device_peak_bytes) + "  (compiler)"),
                ("device memory", gib(self.device_memory_bytes)),
                ("verdict", "FITS" if self.fits else "DOES NOT FIT"),
                ("FLOPs per device", f"{self.flops_per_device / 1e12:.2f} TFLOP per step"),
                ("compile", f"{self.compile_seconds:.0f} s, {self.compiler}"),
                ("host memory", f"{self.host_memory_bytes / 2**30:.2f} GiB peak (this process)")]
        if self.est_step_seconds:
            rows.append(("est. step time", f"{plan_search.seconds(self.est_step_seconds)} for "
                         f"{self.examples_per_step} examples"
                         + (f", MFU {self.est_mfu:.0%}" if self.est_mfu is not None else "")
                         + " (an estimate: FLOPs over the peak, bytes over the links)"))
        rows += [("suggestion", s) for s in self.suggestions]
        text = "\n".join(f"{k:<18}{v}" for k, v in rows)
        return text + ("\n\n" + candidates_table(self.candidates) if self.candidates else "")


def candidates_table(candidates):
    """The layouts searched, one line each: peak, verdict, estimated step time, why it lost."""
    lines = [f"{'layout searched':<24}{'remat':<6}{'scan':<5}{'peak/dev':>10}  {'verdict':<14}"
             f"{'est. step':>10}{'ex./step':>9}  why"]
    for c in candidates:
        peak = "-" if c["peak_bytes"] is None else plan_search.size_text(c["peak_bytes"])
        lines.append(f"{c['layout'].split(',')[0]:<24}{'yes' if c['remat'] else 'no':<6}"
                     f"{'yes' if c['scan'] else 'no':<5}{peak:>10}  {c['status']:<14}"
                     f"{plan_search.seconds(c['est_step_seconds']):>10}"
                     f"{c['examples_per_step']:>9}  {c['why']}")
    return "\n".join(lines)


def parse_bytes(text):
    """'40GiB', '32 GB', '1.5e3MiB', '400000B' -> bytes: a finite number of at least one byte,
    and its unit (a bare number could mean bytes or gigabytes)."""
    m = re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)(?:[eE]([+-]?\d+))?\s*([a-zA-Z]*)\s*", str(text))
    units = "B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
    if not m:
        raise PlanError(f"not a size: {text!r}. Fix: a number and a unit, e.g. 40GiB or 32GB.")
    number, exponent, unit = m.groups()
    if not unit or unit.lower() not in _UNITS:
        raise PlanError(f"{text!r} has {f'the unit {unit!r}' if unit else 'no unit'}. Fix: a "
                        f"number and one of {units}, e.g. 40GiB or 32GB.")
    size = float(f"{number}e{exponent or 0}") * _UNITS[unit.lower()]  # 1e400: inf, not an error
    if not math.isfinite(size) or size < 1:
        raise PlanError(f"{text!r} is {'not a finite size' if size >= 1 else 'less than a byte'}"
                        ". Fix: a device's memory, e.g. 40GiB or 32GB.")
    return int(size)


def _loss_for(model, model_type, stands_in_for_cudnn=False):
    """The planned step's loss; ``stands_in_for_cudnn``: its attention (XLA's, by blocks) stands
    in for the cuDNN kernel the run will call, and the loss holds, as the run's does, an
    operation JAX lowers with the devices in hand (a sharding inspection, compiled away), so that
    the layout makes the choices the run's will (sharding/device_bound.py: K/V heads not kept by
    groups, no positions split)."""
    import optax

    def causal(rng, state, params, batch, is_training):
        logits = model.apply(params, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype("float32"), batch["ids"][:, 1:]).mean()

    def seq2seq(rng, state, params, batch, is_training):
        ids = batch["ids"]
        logits = model.apply(params, ids[:, :-1], batch["mask"], batch["labels"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype("float32"), batch["labels"][:, 1:]).mean()
    loss_fn = seq2seq if model_type in SEQ2SEQ else causal
    if not stands_in_for_cudnn:
        return loss_fn

    def held_as_the_run_holds_it(*args):
        import jax
        loss = loss_fn(*args)
        jax.debug.inspect_array_sharding(loss, callback=lambda sharding: None)
        return loss
    return held_as_the_run_holds_it


def _attempt(config, devices, hosts, device_memory, seq_len, per_device_batch_size, param_dtype,
             optimizer, model_shards, remat, target="cpu", scan_layers=False):
    """Compile the step once, in this process: on its ``devices`` CPU devices, or for the
    compile-only devices of ``target``."""
    import jax
    import jax.numpy as jnp
    import optax

    from ..deployer import Deployer
    from ..layout import megatron_bytes
    from ..layout.memory_check import compiler_refusal
    from ..models.pretrained import model_from_config
    from ..trainer import Trainer

    model_type = json.load(open(_config_file(config))).get("model_type")
    overrides = {"remat": True} if remat else {}
    if scan_layers:
        _check_scannable(model_type)
        overrides["scan_layers"] = True
    # the step computes in the parameters' dtype (a bfloat16 plan is bf16 training: weights,
    # gradients, optimizer state and activations), the model's layers and the Trainer alike
    overrides["dtype"] = jnp.dtype(param_dtype)
    attention = planned_attention(target, param_dtype, model_type)
    if attention:
        overrides["attention_implementation"] = attention
    model, abstract = model_from_config(config, param_dtype=jnp.dtype(param_dtype),
                                        config_overrides=overrides)
    optimizers = {"adamw": optax.adamw(1e-5), "sgd": optax.sgd(1e-5),
                  "adafactor": optax.adafactor(1e-5)}
    shards = devices // hosts if model_shards is None else model_shards
    target_devices, compiler = _target(target, devices, hosts)
    deployer = Deployer(jax_seed=0, n_model_shards=shards, verbose=False,
                        memory_budget_bytes=device_memory, devices=target_devices)
    loss_fn = _loss_for(model, model_type, stands_in_for_cudnn=attention == "blocked")
    trainer = Trainer(deployer, _no_examples, model.apply, loss_fn, abstract,
                      optimizers[optimizer], compute_dtype=jnp.dtype(param_dtype), fsdp=True,
                      fuse_matmuls=True)
    rows = deployer.global_batch_size(per_device_batch_size)
    ids = jax.ShapeDtypeStruct((rows, seq_len + 1), jnp.int32)
    batch = {"ids": ids, "mask": jax.ShapeDtypeStruct((rows, seq_len), jnp.int32), "labels": ids}
    record = PlanRecord(
        config=str(config), model_type=model_type,
        n_params=int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(abstract))),
        devices=devices, hosts=hosts, device_memory_bytes=device_memory, seq_len=seq_len,
        per_device_batch_size=per_device_batch_size, param_dtype=str(param_dtype),
        optimizer=optimizer, remat=remat, scan_layers=scan_layers, layout="", params_bytes=0,
        attention=("blocked by 512 queries, standing in for cuDNN's flash kernel (its memory "
                   "is O(seq) too)") if attention else "",
        optimizer_bytes=0,
        gradient_bytes=0, temporary_bytes=0, per_device_peak_bytes=0, fits=False,
        flops_per_device=0.0, compile_seconds=0.0, compiler="")
    _hold_state(record, trainer)  # as first placed (from the shapes, FSDP on): no compiling yet
    state_bytes = record.params_bytes + record.optimizer_bytes + record.gradient_bytes
    if state_bytes > device_memory:  # hopeless whatever the temporaries: not compiled
        record.per_device_peak_bytes = state_bytes
        record.layout = f"dp={deployer.n_data_shards} x mp={shards} (as first placed)"
        record.compiler = ("not compiled: the training state alone exceeds the device memory "
                           "(the peak shown is that state, a lower bound)")
        return record
    start = time.perf_counter()
    try:
        compiled = trainer.compile_train_step(batch)
    except jax.errors.JaxRuntimeError as e:  # e.g. the TPU compiler refuses a step over its memory
        refusal = compiler_refusal(e)
        if refusal is None:
            raise CompileFailure(
                f"{compiler} failed to compile the training step of {config} (dp="
                f"{deployer.n_data_shards} x mp={shards}, seq {seq_len}, {param_dtype}, "
                f"{optimizer}{', remat' if remat else ''}"
                f"{', layers scanned' if scan_layers else ''}): "
                f"{str(e).strip().splitlines()[0]}. This is the compiler's error, no verdict on "
                "memory. Fix: report it with this command; --target cpu plans with XLA:CPU "
                "standing in.") from e
        record.compile_seconds = time.perf_counter() - start
        _hold_state(record, trainer)
        # the compiler's figure is the device's whole need, the state's arguments included
        record.per_device_peak_bytes = refusal.needed_bytes
        record.temporary_bytes = max(0, refusal.needed_bytes - record.params_bytes
                                     - record.optimizer_bytes)
        record.layout = trainer.layout.description  # each choice said once
        _megatron(record, trainer)
        record.compiler = (f"{compiler}: refused the step at compile time (\"{refusal.message}\"; "
                           "the peak shown is what it said one device needs)")
        return record
    record.compile_seconds = time.perf_counter() - start
    _hold_state(record, trainer)  # as the chosen layout places it
    m = compiled.memory_analysis()
    record.per_device_peak_bytes = int(m.argument_size_in_bytes + m.output_size_in_bytes
                                       - m.alias_size_in_bytes + m.temp_size_in_bytes)
    record.temporary_bytes = int(m.temp_size_in_bytes)
    record.fits = record.per_device_peak_bytes <= device_memory
    # counted in the step's trace: XLA's cost analysis counts a scanned layer once, misses
    # cuBLAS's matmuls and is absent for XLA:GPU compiling without a GPU
    record.flops_per_device = trainer.step_cost(batch).flops_per_device or 0.0
    record.layout = trainer.layout.description  # each choice said once
    _megatron(record, trainer)
    measured, short = megatron_bytes.said(compiled, trainer.layout,  # as a Trainer after a step
                                          trainer.accumulate_grad_batches,
                                          trainer.deployer.log_warning)
    record.megatron_bytes = None if measured.ratio is None else round(measured.ratio, 3)
    record.bytes_short_of_megatron = short or ""
    record.compiler = compiler
    return record


def _megatron(record, trainer):
    """How the chosen plan's parameter split compares with Megatron's, into ``record``."""
    record.megatron_share = round(trainer.layout.plan.megatron_share().ratio, 3)
    record.short_of_megatron = trainer.layout.plan.short_of_megatron() or ""


# TPU v4: 4 chips a host (2 x 2 x 1), one device per chip (megacore); slices by chip count
_TPU_V4_BOUNDS = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
                  128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16),
                  2048: (8, 16, 16), 4096: (16, 16, 16)}
TARGETS = ("cpu", "tpu-v4") + gpu_targets.names()  # GPUs: redcoast/cli/targets/*.json


def _target(target, devices, hosts):
    """``(devices to compile for or None for this process's own, the compiler's description)``."""
    import jax
    if target == "cpu":
        return None, (f"XLA:CPU on {devices} simulated devices (jax {jax.__version__}), standing "
                      "in for the target's compiler")
    if target in gpu_targets.names():  # XLA:GPU, through JAX's CUDA plugin
        return gpu_targets.compile_only_devices(target, devices, hosts, jax.__version__)
    if target != "tpu-v4":
        raise PlanError(f"target {target!r}: use one of {TARGETS}")
    if devices not in _TPU_V4_BOUNDS or devices // 4 != hosts:
        raise PlanError(
            f"--target tpu-v4 with {devices} devices on {hosts} host(s): a TPU v4 slice has 4 "
            f"chips a host and one of {sorted(_TPU_V4_BOUNDS)} chips. Fix: --devices N "
            f"--hosts N/4 with such an N (e.g. --devices 8 --hosts 2), or --target cpu.")
    try:
        from importlib.metadata import PackageNotFoundError, version
        libtpu = version("libtpu")
    except PackageNotFoundError:
        raise PlanError(
            "--target tpu-v4 compiles with the TPU compiler (libtpu), which is not installed. Fix: "
            f"pip install 'jax[tpu]=={jax.__version__}' (on a machine without TPUs it only "
            "compiles), or --target cpu (simulated CPU devices).") from None
    from jax.experimental import topologies
    bounds = _TPU_V4_BOUNDS[devices]
    name = "v4:" + "x".join(map(str, bounds))
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no cloud metadata server to ask
    try:
        topology = topologies.get_topology_desc(
            topology_name=name, platform="tpu", chip_config_name="megacore",
            chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False, False, False))
    except jax.errors.JaxRuntimeError as e:
        if "lockfile" not in str(e):
            raise
        raise PlanError(
            "--target tpu-v4: another process on this machine holds libtpu (its lockfile, "
            "/tmp/libtpu_lockfile), e.g. a second plan for TPU running beside this one. Fix: plan "
            "for TPU one at a time, or, on a machine with no TPU attached, set "
            "ALLOW_MULTIPLE_LIBTPU_LOAD=1 to let several plans compile at once.") from e
    return list(topology.devices), (
        f"the TPU compiler (libtpu {libtpu}, jax {jax.__version__}) for a {name} slice "
        f"described by jax.experimental.topologies: {devices} TPU v4 chips, none of them here")


def _check_scannable(model_type):
    """A clear error when redcoast's model of ``model_type`` cannot run its layers by a scan."""
    if not _scannable(model_type):
        raise PlanError(f"--scan-layers: redcoast's {model_type} model runs its layers unrolled "
                        "(layers stacked for a scan: the families with scan_layers in their "
                        "Config). Fix: plan without "
                        "--scan-layers.")


def _hold_state(record, trainer):
    """The per-device bytes of the state the trainer's layout holds, into ``record``."""
    state = trainer.state
    from ..layout.memory_check import per_device_bytes
    record.params_bytes = per_device_bytes(state.params)
    record.optimizer_bytes = per_device_bytes(state.opt_state)
    record.gradient_bytes = record.params_bytes  # reduced to the parameters' placement


def _no_examples(examples):
    raise AssertionError("a plan compiles for abstract batches; it collates nothing")


def _config_file(config):
    from .config_file import config_path
    return config_path(config)


def planned_attention(target, param_dtype, model_type):
    """The attention the planned step computes where it differs from the model's own choice:
    ``"blocked"`` where the real run would take cuDNN's flash kernel, whose memory is O(seq),
    but the plan's step would not (XLA:CPU standing in for a GPU has no such kernel; on the
    compile-only GPUs models/attention.py sees no CUDA device at trace time, so it would trace
    XLA's O(seq^2) attention): an NVIDIA target or the CPU stand-in in bfloat16 or float16, the
    dtypes for which models/attention.py chooses cuDNN on a GPU. None otherwise:
    float32 runs XLA's attention on a GPU too, TPUs have no cuDNN, and a family without
    ``attention_implementation`` in its Config runs its own."""
    import jax.numpy as jnp

    from ..models.pretrained import family_of
    if target != "cpu" and target not in gpu_targets.names():
        return None
    if jnp.dtype(param_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return None
    fields = {f.name for f in dataclasses.fields(family_of(model_type).Config)}
    return "blocked" if "attention_implementation" in fields else None


def _scannable(model_type):
    """Whether redcoast's model of ``model_type`` can stack its layers and scan them."""
    from ..models.pretrained import family_of
    return "scan_layers" in {f.name for f in dataclasses.fields(family_of(model_type).Config)}


def _model_shape(config, param_dtype, scannable):
    """``(ModelShape, abstract parameters)`` of the model of ``config``, for the estimate and
    the suggestions (built scanned where it can be: faster to build, the same parameters)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from .config_file import read_model_config
    from ..models.pretrained import model_from_config
    fields = read_model_config(config)
    _, abstract = model_from_config(config, param_dtype=jnp.dtype(param_dtype),
                                    config_overrides={"scan_layers": True} if scannable else None)
    n_params = int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(abstract)))
    hidden = next(fields[k] for k in ("hidden_size", "n_embd", "d_model") if k in fields)
    shape = plan_search.ModelShape(n_params, _depth(fields), int(hidden),
                                   np.dtype(param_dtype).itemsize)
    return shape, abstract


def _depth(fields):
    """Layers in all (an encoder-decoder's both stacks) as the config.json names them."""
    if "encoder_layers" in fields:  # BART
        return int(fields["encoder_layers"]) + int(fields.get("decoder_layers") or 0)
    if "num_layers" in fields:  # T5: decoder as deep unless said
        return int(fields["num_layers"]) + int(fields.get("num_decoder_layers")
                                               or fields["num_layers"])
    return int(fields.get("num_hidden_layers") or fields.get("n_layer") or 1)


def _rates(target, param_dtype):
    kind = gpu_targets.description(target)["device_kind"] if target in gpu_targets.names() else None
    return plan_search.rates_for(target, param_dtype, kind)


def plan(config, *, devices, hosts=1, device_memory, seq_len, per_device_batch_size=1,
         param_dtype="float32", optimizer="adamw", model_shards=None, remat=None, target="cpu",
         scan_layers=None):
    """A :class:`PlanRecord` for training the model of ``config`` (a config.json or a folder)
    on ``devices`` devices of ``device_memory`` bytes (or a size like '40GiB'): the fastest
    layout by estimate that the compiler says fits (plan_search.py), with every layout searched
    in ``candidates``. ``model_shards``, ``remat``, ``scan_layers``: None searches (the model
    shards dividing a host's devices; remat off and on; layers scanned and unrolled where the
    family can scan: Llama, OPT, T5 and whichever else has ``scan_layers`` in its Config), a
    value pins it (the run must use the same settings). ``target``: "cpu" compiles for
    simulated CPU devices, standing in for the target's compiler; "tpu-v4" with the TPU
    compiler for a TPU v4 slice of ``devices`` chips (libtpu installed; no TPU needed); a GPU
    of redcoast/cli/targets (``h100``, ...) with the GPU compiler (JAX's CUDA plugin; no GPU needed).

    For "cpu", runs in a fresh process when this one does not have ``devices`` CPU devices
    (at most MAX_SIMULATED_DEVICES there; simulate more in this process first). Every argument
    is checked first: a :class:`PlanError` (or, for the config file,
    :class:`~redcoast.errors.ConfigError`) names the one at fault and the fix."""
    if isinstance(device_memory, str):
        device_memory = parse_bytes(device_memory)
    elif isinstance(device_memory, float) and math.isfinite(device_memory):
        device_memory = int(device_memory)
    _check_request(config, devices, hosts, device_memory, seq_len, per_device_batch_size,
                   param_dtype, optimizer, model_shards)
    model_type = json.load(open(_config_file(config))).get("model_type")
    if scan_layers:
        _check_scannable(model_type)
    import jax
    # simulated CPU devices must be this process's own; a TPU slice's are described, any process
    if target == "cpu" and (jax.device_count() != devices or jax.devices()[0].platform != "cpu"):
        from ..simulate import MAX_SIMULATED_DEVICES, simulation_cost
        if devices > MAX_SIMULATED_DEVICES:
            raise PlanError(f"devices={devices}: planning them would start "
                            f"{simulation_cost(devices)}. "
                            f"Fix: at most {MAX_SIMULATED_DEVICES} devices, `redcoast plan "
                            "--allow-many`, or simulate_cpu_devices(devices) in this process "
                            "before JAX starts, then plan().")
        return _in_subprocess(config, devices, hosts, device_memory, seq_len, per_device_batch_size,
                              param_dtype, optimizer, model_shards, remat, target, scan_layers)
    scannable = _scannable(model_type)
    shape, abstract = _model_shape(config, param_dtype, scannable)
    rates = _rates(target, param_dtype)
    run = plan_search.Run(devices, hosts, seq_len, per_device_batch_size)
    cands = plan_search.candidates(devices, hosts, model_shards, remat, scan_layers, scannable)
    estimates = [plan_search.estimate(c, shape, run, rates) for c in cands]

    def attempt(c, seq=seq_len):
        return _attempt(config, devices, hosts, device_memory, seq, per_device_batch_size,
                        param_dtype, optimizer, c.model_shards, c.remat, target, c.scan)
    outcomes, chosen = plan_search.search(cands, estimates, attempt, devices,
                                          is_failure=_candidates_own_failure)
    if all(o.record is None for o in outcomes):  # no verdict at all: the first error says why
        error = next(o.error for o in outcomes if o.error is not None)
        if isinstance(error, PlanError):
            raise error
        raise PlanError(f"redcoast could not build the training step of {config} for any "
                        f"layout searched; the first ({outcomes[0].candidate.describe(devices)}) "
                        f"failed with {type(error).__name__}: {error}. Fix: report it with this "
                        "command; --model-shards, --remat, --scan-layers pin another layout."
                        ) from error
    best = outcomes[chosen] if chosen is not None else plan_search.smallest(outcomes)
    record = best.record
    record.candidates = [_candidate_row(o, devices, rates) for o in outcomes]
    record.tried = [(o.candidate.describe(devices), o.record.per_device_peak_bytes)
                    for o in outcomes if o.compiled and o is not best]
    record.examples_per_step = best.estimate.examples
    record.est_step_seconds = best.estimate.seconds
    record.est_mfu = best.estimate.mfu if rates.peak_known else None
    record.estimate_basis = rates.source
    if not record.fits:
        record.suggestions = _suggest(record, best, abstract, attempt, model_shards, remat,
                                      scan_layers, scannable)
    elif target == "cpu" and record.per_device_peak_bytes > STAND_IN_MARGIN * device_memory:
        record.suggestions = [stand_in_caution(record)]
    record.host_memory_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return record


# XLA:CPU's peak against the GPU compiler's: 1.35x and 1.60x over (GPT2-Large, TinyLlama) but
# 0.89x under (Llama-3-8B, dp=2 x mp=4, scanned, 4096 tokens: 79.95 against 90.03 GiB)
STAND_IN_MARGIN = 0.85


def stand_in_caution(record):
    """What a stand-in's FITS close to the device's memory is worth, and how to know."""
    return (f"the peak is {record.per_device_peak_bytes / record.device_memory_bytes:.0%} of "
            "the device's memory by XLA:CPU standing in for the target's compiler, whose figure "
            "differs either way (Llama-3-8B at dp=2 x mp=4, 4096 tokens: 79.95 GiB here, 90.03 "
            "by the H100's compiler). Fix: plan with the device's own compiler (--target h100, "
            "h200, a100 or a100-40gb with jax[cuda12] installed; --target tpu-v4 with "
            "jax[tpu]), or pin a layout with more room from the table below.")


def _candidates_own_failure(error):
    """Whether ``error`` is one layout's own (a compiler error, or redcoast failing to build that
    layout's step), which costs that candidate, not the plan; any other PlanError (a target
    that cannot be planned) stops the search."""
    return isinstance(error, CompileFailure) or not isinstance(error, PlanError)


def _candidate_row(outcome, devices, rates):
    """One searched layout as the record keeps it (JSON-ready)."""
    c, e, r = outcome.candidate, outcome.estimate, outcome.record
    return {"layout": c.describe(devices), "model_shards": c.model_shards, "remat": c.remat,
            "scan": c.scan, "status": outcome.status,
            "peak_bytes": None if r is None else r.per_device_peak_bytes,
            "compiled": outcome.compiled, "est_step_seconds": e.seconds,
            "examples_per_step": e.examples,
            "est_mfu": e.mfu if rates.peak_known else None, "why": outcome.why}


def _suggest(record, best, abstract, attempt, model_shards, remat, scan_layers, scannable):
    """What would fit, computed (plan_search.suggest): the state and temporaries of the plan
    that came closest, Adafactor's state from the shapes, and, where that plan compiled, its
    temporaries compiled again at half the sequence to see how they scale."""
    import jax
    import numpy as np
    import optax
    ada = jax.eval_shape(optax.adafactor(1e-5).init, abstract)
    ada_bytes = int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                        for x in jax.tree_util.tree_leaves(ada)))
    half = None
    if best.compiled and record.seq_len >= 2:
        again = attempt(best.candidate, record.seq_len // 2)
        half = again.temporary_bytes if again.compile_seconds else None
    per_host = record.devices // record.hosts
    larger = tuple(d for d in range(best.candidate.model_shards + 1, per_host + 1)
                   if per_host % d == 0) if model_shards else ()
    shortfall = plan_search.Shortfall(
        params=record.params_bytes, optimizer=record.optimizer_bytes,
        gradients=record.gradient_bytes,
        temporaries=record.temporary_bytes if best.compiled else None,
        memory=record.device_memory_bytes, devices=record.devices, hosts=record.hosts,
        seq_len=record.seq_len, model_shards=best.candidate.model_shards,
        param_dtype=record.param_dtype, optimizer_name=record.optimizer,
        adafactor_bytes=ada_bytes, half_seq_temporaries=half, larger_shards=larger,
        remat_pinned_off=remat is False, scan_pinned_off=scan_layers is False and scannable)
    return plan_search.suggest(shortfall)


def _check_request(config, devices, hosts, device_memory, seq_len, per_device_batch_size,
                   param_dtype, optimizer, model_shards):
    """A :class:`PlanError` for a plan that cannot be asked (no compiling yet); a ConfigError
    naming the file and the field for a config.json redcoast cannot build a model from."""
    counts = {"devices": devices, "hosts": hosts, "seq_len": seq_len,
              "per_device_batch_size": per_device_batch_size, "model_shards": model_shards,
              "device_memory": device_memory}
    for name, value in counts.items():
        if value is None and name == "model_shards":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"{name}={value!r}: it must be a whole number, at least 1. Fix: "
                            + ("a size like '40GiB' or a number of bytes."
                               if name == "device_memory"
                               else "a positive count."))
    if devices % hosts:
        raise PlanError(f"devices={devices} on hosts={hosts}: every host holds as many devices, "
                        f"so the devices must be a multiple of the hosts. Fix: e.g. devices="
                        f"{hosts * max(1, devices // hosts)} or hosts=1.")
    if model_shards is not None and devices % model_shards:
        raise PlanError(f"model_shards={model_shards} does not divide devices={devices}: the "
                        "devices form a grid of data x model shards. Fix: a divisor of the "
                        f"devices, e.g. model_shards={math.gcd(model_shards, devices)}, or leave "
                        "it out (the devices of one host).")
    choices = {"param_dtype": (param_dtype, ("float32", "bfloat16")),
               "optimizer": (optimizer, ("adamw", "adafactor", "sgd"))}
    for name, (value, allowed) in choices.items():
        if value not in allowed:
            raise PlanError(f"{name}={value!r}. Fix: one of {allowed}.")
    from .config_file import read_model_config
    model_type = read_model_config(config)["model_type"]
    if model_type in NOT_PLANNED:
        raise PlanError(
            f"{config}: model_type {model_type!r} is {NOT_PLANNED[model_type]}; redcoast plan "
            f"plans language models, trained on token sequences of --seq-len (causal: "
            f"{', '.join(CAUSAL)}; sequence to sequence: {', '.join(SEQ2SEQ)}). Fix: build "
            "your Trainer and read trainer.compile_train_step(batch).memory_analysis() (the "
            "compiler's bytes a device) or trainer.step_cost(batch) on a batch of your own, "
            "which need no examples run.")


def _in_subprocess(config, devices, hosts, device_memory, seq_len, per_device_batch_size,
                   param_dtype, optimizer, model_shards, remat, target, scan_layers):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        command = [sys.executable, "-m", "redcoast", "plan", str(config), "--devices", str(devices),
                   "--hosts", str(hosts), "--device-memory", f"{device_memory}B", "--seq-len",
                   str(seq_len), "--per-device-batch-size", str(per_device_batch_size),
                   "--param-dtype", param_dtype, "--optimizer", optimizer, "--target", target,
                   "--json", out, "--quiet"]
        if model_shards is not None:
            command += ["--model-shards", str(model_shards)]
        if remat is not None:
            command += ["--remat" if remat else "--no-remat"]
        if scan_layers is not None:
            command += ["--scan-layers" if scan_layers else "--no-scan-layers"]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env["JAX_PLATFORMS"] = "cpu"
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"redcoast plan failed:\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-3000:]}")
        with open(out) as f:
            return PlanRecord(**json.load(f))


def main(argv):
    """``redcoast plan ...``: every argument, and the config file, checked before any work."""
    from .arg_types import positive_int
    from ..errors import ConfigError
    from ..simulate import MAX_SIMULATED_DEVICES, simulation_cost
    parser = argparse.ArgumentParser(
        prog="redcoast plan", description="Plan a training run for hardware you do not have: "
        "the layout, the memory per device, FITS or DOES NOT FIT.")
    parser.add_argument("config", help="a Hugging Face config.json, or a folder holding one")
    parser.add_argument("--devices", type=positive_int, required=True, help="devices in all")
    parser.add_argument("--hosts", type=positive_int, default=1,
                        help="hosts the devices are on, as many on each (default 1)")
    parser.add_argument("--device-memory", type=_memory_arg, required=True,
                        help="per device, a number and a unit: e.g. 40GiB, 32GB")
    parser.add_argument("--seq-len", type=positive_int, required=True)
    parser.add_argument("--per-device-batch-size", type=positive_int, default=1,
                        help="examples per data shard (default 1)")
    parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the parameters' dtype, which the step also computes in (bfloat16: "
                             "weights, gradients, optimizer state and activations in bf16)")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "adafactor", "sgd"])
    parser.add_argument("--model-shards", type=positive_int,
                        help="a divisor of --devices; default: searched over the divisors of "
                        "a host's devices")
    parser.add_argument("--remat", action="store_true", default=None,
                        help="each layer rematerialised (default: searched, off and on)")
    parser.add_argument("--no-remat", dest="remat", action="store_false")
    parser.add_argument("--scan-layers", action="store_true", default=None,
                        help="the layers stacked and run by a scan: one layer compiled whatever "
                        "their number (families with scan_layers in their Config; train with "
                        "scan_layers=True too). Default: tried where the family can")
    parser.add_argument("--no-scan-layers", dest="scan_layers", action="store_false")
    parser.add_argument("--target", default="cpu", choices=TARGETS,
                        help="whose compiler gives the memory: 'cpu' (default) simulated CPU "
                        "devices standing in; 'tpu-v4' the TPU compiler for a v4 slice (needs "
                        "libtpu: pip install 'jax[tpu]'; no TPU needed)")
    parser.add_argument("--allow-many", action="store_true",
                        help=f"with --target cpu, simulate more than {MAX_SIMULATED_DEVICES} "
                        "devices (slow: see the error without it)")
    parser.add_argument("--json", help="also write the record here")
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    args = parser.parse_args(argv)
    if args.devices % args.hosts:
        parser.error(f"--devices {args.devices} is not a multiple of --hosts {args.hosts}: every "
                     "host holds as many devices. Fix: e.g. --devices "
                     f"{args.hosts * max(1, args.devices // args.hosts)} --hosts {args.hosts}.")
    if args.model_shards is not None and args.devices % args.model_shards:
        parser.error(f"--model-shards {args.model_shards} does not divide --devices "
                     f"{args.devices} (the devices form a grid of data x model shards). Fix: a "
                     "divisor of --devices, or leave it out (the devices of one host).")
    if args.target == "cpu" and args.devices > MAX_SIMULATED_DEVICES:
        if not args.allow_many:
            parser.error(f"--devices {args.devices} with --target cpu would start "
                         f"{simulation_cost(args.devices)}. Fix: at most "
                         f"{MAX_SIMULATED_DEVICES} devices, a target compiled for without "
                         "simulating its devices (--target tpu-v4, or a GPU such as --target "
                         "h100), or --allow-many to simulate them all the same.")
        print(f"redcoast plan: warning: {simulation_cost(args.devices)}; --allow-many: "
              "simulating them, slowly.", file=sys.stderr, flush=True)
    from .config_file import read_model_config
    try:
        read_model_config(args.config)  # before JAX starts: its errors name the file and field
    except ConfigError as e:
        parser.error(str(e))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.target == "cpu":
        import warnings

        from ..simulate import simulate_cpu_devices
        with warnings.catch_warnings():  # said above
            warnings.simplefilter("ignore")
            simulate_cpu_devices(args.devices)  # before JAX starts its backend
    try:
        record = plan(args.config, devices=args.devices, hosts=args.hosts,
                      device_memory=args.device_memory, seq_len=args.seq_len,
                      per_device_batch_size=args.per_device_batch_size,
                      param_dtype=args.param_dtype, optimizer=args.optimizer,
                      model_shards=args.model_shards, remat=args.remat, target=args.target,
                      scan_layers=args.scan_layers)
    except (PlanError, ConfigError) as e:
        parser.error(str(e))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dataclasses.asdict(record), f, indent=1)
    if not args.quiet:
        print(record.table())
    return 0


def _memory_arg(text):
    """``--device-memory``: bytes, or argparse's usage error naming the flag."""
    try:
        return parse_bytes(text)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
