"""A run as data: one record of what ``Deployer``, ``Trainer`` and ``Trainer.fit`` take, and of
what ``redcoast train`` loads (model, data, optimizer, LoRA), read and written as YAML or JSON.

    cfg = RunConfig.load("run.yaml")                      # or RunConfig.from_args(sys.argv[1:])
    deployer = Deployer(**cfg.deployer_kwargs())
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optimizer,
                      **cfg.trainer_kwargs())
    trainer.fit(train_examples, **cfg.fit_kwargs(), eval_examples=eval_examples)

The ``deployer``, ``trainer`` and ``fit`` sections mirror the keyword arguments that are data
(numbers, strings, flags, lists) under the same names and defaults; functions, arrays and
objects (``collate_fn``, ``params``, ``optimizer``, ...) stay in Python: :data:`NOT_DATA` names
them, and tests/test_run_config.py fails when a keyword is in neither. Reading, validating and
command-line overrides (``--trainer.fsdp=false``) are draccus's, PyYAML writes: both come with
the ``train`` extra (``pip install 'redcoast[train]'``). The core never imports this module.
"""

import argparse
import dataclasses
import json
import os
import typing
from typing import Any, Literal, Optional, Union

from ..errors import ConfigError
from .run_checks import did_you_mean

EXTRA = "pip install 'redcoast[train]'"  # what brings draccus and PyYAML

# Keywords that are not data, by callable: they stay arguments of the Python call.
NOT_DATA = {
    "Deployer": {"devices": "jax.Device objects (a compile-only target's); all devices of the run when left out"},
    "Trainer": {
        "deployer": "the Deployer object (built from the deployer section)",
        "collate_fn": "a function", "apply_fn": "a function", "loss_fn": "a function",
        "params": "arrays", "optimizer": "an optax object (redcoast train: the optimizer section)",
        "lr_schedule_fn": "a function (redcoast train: from the optimizer section)",
        "train_step_fn": "a function", "frozen_params": "arrays (redcoast train: the base under LoRA)"},
    "fit": {
        "train_examples": "examples (redcoast train: the data section)",
        "eval_examples": "examples (redcoast train: the data section)",
        "eval_predictor": "a Predictor object", "eval_metric_fn": "a function",
        "checkpoint_files": "files kept with every checkpoint (redcoast train: the record)",
        "callbacks": "Callback objects (redcoast/callbacks.py)"},
}


@dataclasses.dataclass(frozen=True)
class DeployerConfig:
    """``Deployer(...)``'s data keywords (redcoast/deployer.py)."""

    jax_seed: int = 0
    n_model_shards: Union[int, str] = 1  # or "auto"
    workdir: Optional[str] = None
    verbose: bool = True
    run_tensorboard: bool = False
    wandb_init_kwargs: Optional[dict] = None
    n_processes: Optional[int] = None
    host0_address: Optional[str] = None
    host0_port: Optional[int] = None
    process_id: Optional[int] = None
    n_local_devices: Optional[int] = None
    memory_budget_bytes: Optional[int] = None

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """``Trainer(...)``'s data keywords (redcoast/trainer.py). ``compute_dtype`` by name
    (``"bfloat16"``); each sharding rule as ``[[regex, ...], [axis or null, ...]]``, the paper's
    format as the Trainer prints it."""

    accumulate_grad_batches: int = 1
    params_sharding_rules: Optional[list[tuple[tuple[str, ...], tuple[Optional[str], ...]]]] = None
    compute_dtype: str = "float32"
    fsdp: Optional[bool] = None
    fuse_matmuls: Optional[bool] = None
    log_grad_norm: bool = False
    eval_by: Optional[str] = None  # "example" or "batch"

    def kwargs(self) -> dict:
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec

        out = dataclasses.asdict(self)
        try:  # by name, as jnp's own (jnp.bfloat16, the Trainer's default jnp.float32)
            out["compute_dtype"] = getattr(jnp, jnp.dtype(self.compute_dtype).name)
        except TypeError:
            raise ConfigError(f"trainer.compute_dtype={self.compute_dtype!r} is not a dtype name. "
                              "Fix: 'float32', 'bfloat16' or 'float16'.") from None
        if self.params_sharding_rules is not None:
            out["params_sharding_rules"] = [(tuple(regexes), PartitionSpec(*axes))
                                            for regexes, axes in self.params_sharding_rules]
        return out


@dataclasses.dataclass(frozen=True)
class FitConfig:
    """``Trainer.fit(...)``'s data keywords (redcoast/trainer.py). ``per_device_batch_size``
    and ``n_epochs``, which fit requires, default to 8 and 1 here."""

    per_device_batch_size: int = 8
    n_epochs: Optional[int] = 1
    eval_per_device_batch_size: Optional[int] = None
    eval_loss: bool = True
    save_every_n_steps: Optional[int] = None
    save_every_k_epochs: Optional[int] = None
    save_last_ckpt: Optional[bool] = None  # None: where the run can resume (fit's default)
    save_argmin_ckpt_by_metrics: Optional[list[str]] = None
    save_argmax_ckpt_by_metrics: Optional[list[str]] = None
    keep_last_n_ckpts: Optional[int] = None
    resume: bool = True
    log_every_n_steps: int = 10
    shuffle: bool = True
    max_steps: Optional[int] = None
    eval_every_n_steps: Optional[int] = None
    check_layout: bool = False

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model of ``redcoast train``: ``path`` is a Hugging Face folder (config.json and
    safetensors), a GGUF file, or a config.json (or a folder holding only one) whose weights
    are initialised fresh from ``deployer.jax_seed``. ``tokenizer``: a tokenizer.json (default:
    the folder's, or the GGUF file's own). ``task``: the loss, ``causal_lm`` (next token) or
    ``seq2seq`` (encoder-decoder); ``auto`` by the model's family. ``remat``: recompute each
    layer's activations in the backward pass instead of keeping them (less memory, about a
    third more compute; Hugging Face's, TRL's and axolotl's ``gradient_checkpointing``)."""

    path: str = ""
    tokenizer: Optional[str] = None
    task: Literal["auto", "causal_lm", "seq2seq"] = "auto"
    param_dtype: str = "float32"
    remat: bool = False


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Examples from files (``.jsonl``, ``.json``: a list of objects, ``.csv``, ``.txt``: a
    line each), in one of TRL's dataset formats (``format``; ``auto``: by the first record's
    fields):

    - ``text``: ``text_field``, trained on every token;
    - ``prompt_completion``: ``prompt_field`` and ``completion_field``, trained on the
      completion only (the target, for seq2seq);
    - ``messages``: ``messages_field``, a conversation (``[{"role": ..., "content": ...}]``)
      rendered by the model's own chat template and trained on the assistant's tokens only
      (TRL's conversational format with ``assistant_only_loss``; axolotl's ``type:
      chat_template`` with ``roles_to_train: [assistant]``).

    Sequences are cut at ``max_length`` tokens (source and target each, for seq2seq).
    ``packing``: whole sequences packed into rows of ``max_length`` tokens, each attending
    within itself (TRL's ``packing``, axolotl's ``sample_packing``; causal LMs). ``eval``: a
    file of held-out examples; or ``eval_fraction``: that share of ``train``'s records held
    out, drawn with ``split_seed`` (axolotl's ``val_set_size``, datasets' ``train_test_split
    (test_size, seed)``)."""

    train: str = ""
    eval: Optional[str] = None
    format: Literal["auto", "text", "prompt_completion", "messages"] = "auto"
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    max_length: int = 512
    packing: bool = False
    eval_fraction: Optional[float] = None
    split_seed: int = 0


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW on ``Deployer.get_lr_schedule_fn``'s schedule over the run's updates; gradients
    clipped to ``max_grad_norm`` where given."""

    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    schedule_type: str = "linear"  # or "cosine", "constant"
    warmup_rate: float = 0.0
    max_grad_norm: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters (redcoast/lora.py) on the kernels ``targets`` matches, the base frozen;
    ``rank: 0`` (the default) trains the whole model. ``save``: what ``export`` holds at the
    end: ``merged`` (a Hugging Face folder, LoRA merged in), ``peft`` (a PEFT adapter folder,
    as TRL and axolotl save a LoRA run: ``PeftModel.from_pretrained(base, export)``) or
    ``both`` (the merged folder, the PEFT folder in ``<export>/adapter``)."""

    rank: int = 0
    alpha: float = 16.0
    targets: str = r"(^|/)(q_proj|v_proj|query|value|q|v|c_attn)/kernel$"  # lora.DEFAULT_TARGETS
    save: Literal["merged", "peft", "both"] = "merged"


@dataclasses.dataclass(frozen=True)
class ResumeConfig:
    """How ``redcoast train`` continues a run whose workdir holds checkpoints: refused where the
    record differs from the one stored with the newest checkpoint, each change named, unless
    ``allow_changes`` (or ``--allow-changes``): then each change is logged and both records kept
    (redcoast/cli/run_record.py says which fields count)."""

    allow_changes: bool = False


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One training run as data (see the module's docstring). ``export``: a Hugging Face folder
    written at the end (LoRA merged in); ``eval_at_start``: evaluate the model before training
    (logged as ``eval_loss_at_start``); ``simulate_cpu_devices``: on a CPU, run on this many
    simulated devices; ``resume``: whether a resume may change the record (ResumeConfig)."""

    deployer: DeployerConfig = dataclasses.field(default_factory=DeployerConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    fit: FitConfig = dataclasses.field(default_factory=FitConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    resume: ResumeConfig = dataclasses.field(default_factory=ResumeConfig)
    export: Optional[str] = None
    eval_at_start: bool = False
    simulate_cpu_devices: Optional[int] = None

    # ------------------------------------------------------------------ as keyword arguments

    def deployer_kwargs(self) -> dict:
        return self.deployer.kwargs()

    def trainer_kwargs(self) -> dict:
        return self.trainer.kwargs()

    def fit_kwargs(self) -> dict:
        return self.fit.kwargs()

    def check_values(self) -> None:
        """Refuse values no run can mean (``data.max_length: 0``, a negative learning rate, ...):
        one :class:`ConfigError` naming each by its YAML path, with the value and the fix
        (redcoast/cli/run_checks.py)."""
        from .run_checks import check_values
        check_values(self)

    # ------------------------------------------------------------------ as text

    def to_dict(self) -> dict:
        """Plain dicts, lists, strings, numbers and None (JSON's values)."""
        return _draccus().encode(self)

    @classmethod
    def from_dict(cls, raw: Any, source: str = "the run config") -> "RunConfig":
        """The record ``raw`` describes; unknown keys and values of the wrong type are a
        :class:`ConfigError` naming them (and, for a key, the valid ones)."""
        check_keys(raw, cls, source)
        draccus = _draccus()
        try:
            return draccus.decode(cls, raw)
        except draccus.utils.DecodingError as e:
            raise ConfigError(f"{source}: {_one_line(e)}. Fix: give that field a value of its "
                              "type (redcoast/cli/run_config.py lists them).") from None

    def to_yaml(self) -> str:
        # field order kept (not sorted): the file reads as the sections are documented
        return _yaml().dump(self.to_dict(), Dumper=_dumper(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str, source: str = "the run config") -> "RunConfig":
        yaml = _yaml()
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{source} is not valid YAML: {e}. Fix: correct the file.") from None
        return cls.from_dict({} if raw is None else raw, source)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "the run config") -> "RunConfig":
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{source} is not valid JSON: {e}. Fix: correct the file.") from None
        return cls.from_dict(raw, source)

    @classmethod
    def load(cls, path: str) -> "RunConfig":
        """From a ``.json`` file, or YAML (any other name)."""
        text = _read(path)
        return (cls.from_json if path.endswith(".json") else cls.from_yaml)(text, path)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() if path.endswith(".json") else self.to_yaml())

    @classmethod
    def from_args(cls, argv: list[str], prog: str = "redcoast train") -> "RunConfig":
        """``[run.yaml] [--section.field=value ...]``: the file (if given), each override
        replacing one field (YAML values: ``--trainer.fsdp=false``, ``--fit.max_steps=null``)."""
        argv = list(argv)
        path = argv.pop(0) if argv and not argv[0].startswith("-") else None
        if path is not None:
            cls.load(path)  # the file's own errors, named with their key and the valid ones
        check_override_names(argv, cls)
        draccus = _draccus()
        try:
            return draccus.parse(cls, config_path=path, args=argv, prog=prog,
                                 exit_on_error=False)
        except (draccus.utils.DraccusException, argparse.ArgumentError) as e:
            raise ConfigError(f"{prog}: {_one_line(e)}. Fix: give each --section.field a value "
                              "of its type (--help lists them).") from None


# ---------------------------------------------------------------------------- validation


def check_keys(raw: Any, cls: type, source: str, prefix: str = "") -> None:
    """Every key of ``raw`` names a field of dataclass ``cls`` (recursively, into sections)."""
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where} must be a mapping of keys to values, not "
                          f"{type(raw).__name__} ({raw!r:.60}). Fix: write `key: value` lines.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"{source}: unknown key {prefix + str(key)!r}"
                              f"{_known_as(key) or did_you_mean(key, fields, prefix)}. Valid keys "
                              f"at {where}: {', '.join(fields)}.")
        section = fields[key].type
        if dataclasses.is_dataclass(section) and value is not None:
            check_keys(value, section, source, f"{prefix}{key}.")
        else:
            check_choice(section, value, f"{source}: {prefix}{key}")


def check_override_names(argv: list[str], cls: type) -> None:
    """Each ``--a.b=value`` names a field (``--help`` and ``-h`` pass through)."""
    for arg in argv:
        if not arg.startswith("--") or arg in ("--help",):
            continue
        name = arg[2:].split("=", 1)[0]
        parts = name.split(".")
        section = cls
        for i, part in enumerate(parts):
            fields = ({f.name: f for f in dataclasses.fields(section)}
                      if dataclasses.is_dataclass(section) else {})
            if part not in fields:
                prefix = "".join(f"{p}." for p in parts[:i])
                rest = "".join(f".{p}" for p in parts[i + 1:])
                valid = ", ".join(f"--{prefix}{f}" for f in fields)
                hint = _known_as(part) or did_you_mean(part, fields, "--" + prefix, rest)
                raise ConfigError(f"unknown option --{name}{hint}. Valid "
                                  f"{'here' if valid else 'after --' + prefix[:-1]}: "
                                  f"{valid or 'none (it takes a value, not fields)'}.")
            section = fields[part].type
        if "=" in arg:
            check_choice(section, yaml_value(arg.split("=", 1)[1]), f"--{name}")


def check_choice(annotation: Any, value: Any, where: str) -> None:
    """``value`` is one of a ``Literal`` field's choices (else a ConfigError naming the close
    one); other fields are draccus's to check."""
    choices = typing.get_args(annotation) if typing.get_origin(annotation) is Literal else ()
    if choices and value not in choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}"
                          f"{did_you_mean(value, choices)}. Fix: choose one of them.")


def yaml_value(text: str) -> Any:
    """A command-line value as draccus reads it (YAML: ``null``, ``3``, ``true``, text)."""
    try:
        return _yaml().safe_load(text)
    except Exception:  # noqa: BLE001 - not YAML: the text itself, for draccus to judge
        return text



# The names TRL's SFTConfig, Hugging Face's TrainingArguments and axolotl give the options a
# run file has under other names: an unknown key that is one of them says which it is here.
KNOWN_AS = {
    "sample_packing": "data.packing", "val_set_size": "data.eval_fraction",
    "test_size": "data.eval_fraction", "gradient_checkpointing": "model.remat",
    "field_messages": "data.messages_field", "dataset_text_field": "data.text_field",
    "sequence_len": "data.max_length", "max_seq_length": "data.max_length",
    "assistant_only_loss": "data.format: messages (trained on the assistant's tokens only)",
    "lora_r": "lora.rank", "r": "lora.rank", "lora_alpha": "lora.alpha",
    "lora_target_modules": "lora.targets", "target_modules": "lora.targets",
    "adapter": "lora.rank (0: no adapters)", "output_dir": "deployer.workdir (and export)",
    "num_epochs": "fit.n_epochs", "num_train_epochs": "fit.n_epochs",
    "micro_batch_size": "fit.per_device_batch_size",
    "per_device_train_batch_size": "fit.per_device_batch_size",
    "gradient_accumulation_steps": "trainer.accumulate_grad_batches",
    "learning_rate": "optimizer.learning_rate", "seed": "deployer.jax_seed",
    "base_model": "model.path", "model_name_or_path": "model.path"}


def _known_as(key) -> str:
    return f" ({key} is {KNOWN_AS[key]} here)" if key in KNOWN_AS else ""


def _one_line(error) -> str:
    return " ".join(str(error).split())


def _dumper():
    """PyYAML's safe dumper writing a list of plain values on one line (``[loss, acc]``)."""
    yaml = _yaml()

    class Dumper(yaml.SafeDumper):
        pass

    def represent_list(dumper, data):
        flat = not any(isinstance(x, (list, tuple, dict)) for x in data)
        return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)

    Dumper.add_representer(list, represent_list)
    return Dumper


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read the run config {path}: {e.strerror}. Fix: give the path "
                          "of a YAML or JSON file.") from None


def _draccus():
    try:
        import draccus
        import draccus.utils  # noqa: F401 - its errors
    except ImportError:
        raise ConfigError(f"reading a run config needs draccus. Fix: {EXTRA}") from None
    return draccus


def _yaml():
    try:
        import yaml
    except ImportError:
        raise ConfigError(f"run configs as YAML need PyYAML. Fix: {EXTRA}") from None
    return yaml


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its relative local paths made absolute (against the current directory),
    so that the record stored with a run reruns from anywhere."""
    from ..store.workdir import absolute

    def local(path):
        return path if not path or "://" in path else os.path.abspath(path)

    return dataclasses.replace(
        cfg,
        deployer=dataclasses.replace(cfg.deployer, workdir=cfg.deployer.workdir and absolute(cfg.deployer.workdir)),
        model=dataclasses.replace(cfg.model, path=local(cfg.model.path),
                                  tokenizer=cfg.model.tokenizer and local(cfg.model.tokenizer)),
        data=dataclasses.replace(cfg.data, train=local(cfg.data.train),
                                 eval=cfg.data.eval and local(cfg.data.eval)),
        export=cfg.export and local(cfg.export))
