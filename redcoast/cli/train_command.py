"""``redcoast train run.yaml [--section.field=value ...]``: a run written down as a file.

    redcoast train run.yaml
    redcoast train run.yaml --trainer.fsdp=false --fit.n_epochs=3 --lora.rank=8
    redcoast train run.yaml --optimizer.learning_rate=1e-5 --allow-changes

Fine-tunes a Hugging Face folder, a GGUF file, or a fresh model from a config.json on records
from files (redcoast/cli/text_task.py): text, prompt/completion, or conversations through the
model's own chat template (trained on the assistant's tokens), padded or packed, a held-out
share optional; a causal-LM or seq2seq loss; LoRA optional, exported merged or as a PEFT
folder. The file is a :class:`~redcoast.cli.run_config.RunConfig`; each ``--section.field=value`` replaces one
field. Values no run can mean (``data.max_length: 0``, a negative learning rate) are refused
before any work (redcoast/cli/run_checks.py). The record of the run (overrides applied, paths
absolute) is printed at the start and written to ``<workdir>/run.yaml`` and into every
checkpoint (``files/run.yaml``): ``redcoast train`` on that file reruns the run, and on a
workdir holding checkpoints ``fit`` resumes it (a SIGTERM saves and exits; the same command
continues). A resume under another record is refused, each change named, unless
``--allow-changes``; every record a run ran under is kept in ``<workdir>/run-history/``
(redcoast/cli/run_record.py).
"""

import dataclasses
import os
import sys

from ..errors import ConfigError, DataError
from ..store.folder_files import file_in_folder
from .run_config import ResumeConfig, RunConfig, absolute_paths
from .run_record import HISTORY, RECORD, check_resume, keep, newest_checkpoint

ALLOW_CHANGES = "--allow-changes"  # the same as --resume.allow_changes=true
PEFT_SUBFOLDER = "adapter"  # lora.save: both: the PEFT folder inside the merged model's
SEQ2SEQ_FAMILIES = ("t5", "bart")
CAUSAL_FAMILIES = ("llama", "gpt2", "opt", "gptj")


def main(argv=None) -> int:
    """Entry point of ``redcoast train``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or (len(argv) == 1 and argv[0] in ("-h", "--help")):
        examples, description = __doc__.split("\n\n")[1:3]
        print(f"usage: redcoast train run.yaml [--section.field=value ...] [{ALLOW_CHANGES}]"
              f"\n\n{examples}\n\n"
              f"{description.strip()}\n\nEvery field: redcoast train run.yaml --help; what each "
              "means: redcoast/cli/run_config.py.")
        return 0 if argv else 2
    allow = ALLOW_CHANGES in argv
    argv = [a for a in argv if a != ALLOW_CHANGES]
    try:
        cfg = absolute_paths(RunConfig.from_args(argv))
        if allow:
            cfg = dataclasses.replace(cfg, resume=ResumeConfig(allow_changes=True))
        check(cfg)
        train(cfg)
    except (ConfigError, DataError) as e:  # the cause and the fix, without a traceback
        print(f"redcoast train: {e}", file=sys.stderr)
        return 2
    return 0


def check(cfg: RunConfig) -> None:
    """What ``redcoast train`` needs beyond what the record's types say: the files, a workdir,
    values a run can mean."""
    missing = [name for name, value in (("model.path", cfg.model.path), ("data.train", cfg.data.train),
                                        ("deployer.workdir", cfg.deployer.workdir)) if not value]
    if missing:
        raise ConfigError(f"the run config sets no {', '.join(missing)}; redcoast train needs "
                          "a model, training data and a workdir (for its checkpoints and "
                          f"record). Fix: set them in the file or as --{missing[0]}=...")
    cfg.check_values()
    for name, path in (("model.path", cfg.model.path), ("model.tokenizer", cfg.model.tokenizer),
                       ("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
        if path is not None and not os.path.exists(path):
            raise ConfigError(f"{name}: {path} does not exist (relative paths are read from the "
                              "current directory). Fix: give the path of an existing file or "
                              "folder.")


def train(cfg: RunConfig):
    """Run ``cfg`` to its end (or to a signal: saved, then SystemExit); the trainer. A resume
    under another record than its checkpoint's is refused first, unless allowed."""
    resume = check_resume(cfg)  # before any work, on every process
    if cfg.simulate_cpu_devices:  # before JAX starts its backend
        from ..simulate import simulate_cpu_devices
        simulate_cpu_devices(cfg.simulate_cpu_devices)
    import jax
    from etils import epath

    from ..deployer import Deployer

    record = cfg.to_yaml()
    with Deployer(**cfg.deployer_kwargs()) as deployer:
        where = epath.Path(deployer.workdir) / RECORD  # a local path or a URL (gs://...)
        deployer.log_info(record.rstrip("\n"), title=f"run config (kept as {where}, in "
                                                      f"{HISTORY}/ and in every checkpoint):")
        if jax.process_index() == 0:
            keep(deployer.workdir, record, resume, deployer.log_info, deployer.log_warning)
        return _train(cfg, deployer, record)


def _train(cfg, deployer, record):
    from .text_task import make_loss_fn
    from ..trainer import Trainer

    model, params, tokenizer, family = load_model(cfg.model, deployer, cfg.trainer.compute_dtype)
    task = task_of(cfg.model.task, family)
    tokens = special_tokens(model, tokenizer)
    train_examples, eval_examples, collate_fn = load_examples(
        cfg.data, task, tokens, model.chat_template, deployer)

    lora, frozen = None, None
    if cfg.lora.rank:
        from ..lora import LoRA, count
        lora = LoRA(rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=cfg.lora.targets)
        frozen, params = params, lora.init(params, seed=deployer.jax_seed)
        deployer.log_info(f"LoRA rank {lora.rank}: {count(params):,} trainable parameters on "
                          f"{len(lora.selected(frozen))} kernels, {count(frozen):,} frozen")
        if cfg.export and cfg.lora.save != "merged":
            check_peft_export(model, lora, params)  # before training, not after it
    optimizer, schedule = make_optimizer(cfg, deployer, len(train_examples))
    trainer = Trainer(deployer, collate_fn, model.apply, make_loss_fn(model, task, lora), params,
                      optimizer, lr_schedule_fn=schedule, frozen_params=frozen,
                      **cfg.trainer_kwargs())
    del params, frozen  # the trainer holds its own copies
    eval_batch = cfg.fit.eval_per_device_batch_size or cfg.fit.per_device_batch_size
    resuming = cfg.fit.resume and newest_checkpoint(cfg.deployer.workdir) is not None
    if cfg.eval_at_start and eval_examples and not resuming:  # logged once, at the run's start
        loss = trainer.eval_loss(eval_examples, eval_batch)
        deployer.log_info(f"eval loss before training: {loss:.4f}")
        deployer.log_metrics({"eval_loss_at_start": loss}, 0)
    history = trainer.fit(train_examples, eval_examples=eval_examples,
                          checkpoint_files={RECORD: record}, **cfg.fit_kwargs())
    if cfg.export and history.already_complete and _exported(cfg, lora):
        deployer.log_info(f"{cfg.export} already holds this complete run's export: kept as it is")
    elif cfg.export:
        export(cfg, model, tokenizer, trainer, lora, deployer)
    return trainer


def _exported(cfg, lora):
    """Whether ``cfg.export`` holds every file the export writes last (a local folder)."""
    save = cfg.lora.save if lora is not None else "merged"
    wanted = []
    if save in ("merged", "both"):
        wanted.append([os.path.join(cfg.export, name)
                       for name in ("model.safetensors", "model.safetensors.index.json")])
    if save in ("peft", "both"):
        folder = cfg.export if save == "peft" else os.path.join(cfg.export, PEFT_SUBFOLDER)
        wanted.append([os.path.join(folder, "adapter_model.safetensors")])
    return all(any(os.path.isfile(path) for path in paths) for paths in wanted)


def load_examples(data, task, tokens, template, deployer):
    """``(train examples, eval examples or None, collate_fn)`` of the data section: records
    read, held out (``eval_fraction``), tokenised in their format, padded or packed."""
    from .text_task import (lengths, make_collate_fn, packing_rows, collate_rows, read_records,
                            split_records, tokenise, trained_tokens)
    from ..text.packing import packed_fraction

    fields = (data.text_field, data.prompt_field, data.completion_field)

    def examples(records, source):
        return tokenise(records, tokens, task, fields, source, data.format, data.messages_field,
                        template)

    records = read_records(data.train, data.text_field)
    held_out = None
    if data.eval_fraction is not None:
        records, held_out = split_records(records, data.eval_fraction, data.split_seed)
        deployer.log_info(f"data.eval_fraction={data.eval_fraction}: {len(held_out)} of "
                          f"{len(records) + len(held_out)} records of {data.train} held out for "
                          f"evaluation (drawn with data.split_seed={data.split_seed})")
    train = examples(records, data.train)
    evals = (examples(held_out, f"{data.train} (held out)") if held_out is not None else
             None if data.eval is None else
             examples(read_records(data.eval, data.text_field), data.eval))
    idle = sum(trained_tokens(e) == 0 for e in train)
    if idle == len(train):
        raise ConfigError(f"{data.train}: no record has a token to train on (no assistant "
                          "message, or an empty completion). Fix: check data.format and the "
                          "records' fields.")
    if idle:  # said, not skipped silently: they still count as examples
        deployer.log_warning(f"{idle} of {len(train)} records of {data.train} have no token to "
                             "train on (no assistant message, or an empty completion): they "
                             "add nothing to the loss.")
    if data.packing:
        everything = train + (evals or [])
        cut = sum(len(e["ids"]) > data.max_length for e in everything)
        rows = packing_rows(train, data.max_length, tokens.pad)
        eval_rows = None if evals is None else packing_rows(evals, data.max_length, tokens.pad,
                                                            pack=False)
        deployer.log_info(
            f"{task}, packed: {len(train)} training examples in {len(rows)} rows of "
            f"data.max_length={data.max_length} tokens ({100 * packed_fraction(rows):.0f}% "
            f"real tokens), {len(evals or [])} eval examples one per row"
            + (f"; {cut} longer ones cut at {data.max_length} tokens" if cut else ""))
        return rows, eval_rows, collate_rows
    shape, cut = lengths(train + (evals or []), data.max_length)
    deployer.log_info(f"{task}: {len(train)} training and {len(evals or [])} eval examples, "
                      f"padded to {' + '.join(map(str, shape))} tokens"
                      + (f"; {cut} longer ones cut at data.max_length={data.max_length}"
                         if cut else ""))
    return train, evals, make_collate_fn(task, shape, tokens.pad, tokens.start)


def check_peft_export(model, lora, adapters):
    """Refuse, before training, adapters PEFT's format cannot hold (written to a scratch
    folder as the end of the run would write them)."""
    import tempfile

    from ..models.peft import save_peft_adapters

    with tempfile.TemporaryDirectory() as scratch:
        save_peft_adapters(model, lora, adapters, scratch)


def export(cfg, model, tokenizer, trainer, lora, deployer):
    """What ``export`` holds: the model (LoRA merged in), and/or the PEFT adapter folder."""
    save = cfg.lora.save if lora is not None else "merged"
    if save in ("merged", "both"):
        from ..models import save_pretrained
        params = (trainer.params if lora is None else
                  lora.merge(trainer.frozen_params, trainer.params))
        save_pretrained(model, params, cfg.export, tokenizer=tokenizer)
        deployer.log_info(f"the trained model is in {cfg.export} (a Hugging Face folder"
                          + (", LoRA merged in)" if lora else ")"))
    if save in ("peft", "both"):
        from ..models.peft import save_peft_adapters
        folder = cfg.export if save == "peft" else os.path.join(cfg.export, PEFT_SUBFOLDER)
        if "://" not in folder:
            os.makedirs(folder, exist_ok=True)
        save_peft_adapters(model, lora, trainer.params, folder)
        deployer.log_info(f"the LoRA adapters are in {folder} (a PEFT folder: "
                          "peft.PeftModel.from_pretrained(<the base model>, folder))")


def load_model(model_cfg, deployer, compute_dtype="float32"):
    """``(model, params, tokenizer, family)`` from ``model.path``: a GGUF file, a Hugging Face
    folder with weights, or a config.json (a folder with no weights) initialised fresh. The
    model computes in ``compute_dtype`` (``trainer.compute_dtype``, as TRL's ``bf16: true``
    does): left at its float32 ``dtype`` it would cast the Trainer's bf16 parameters back up."""
    import jax.numpy as jnp

    from ..models import from_gguf, from_pretrained

    path, dtype = model_cfg.path, jnp.dtype(model_cfg.param_dtype)
    overrides = {"remat": True} if model_cfg.remat else {}
    if jnp.dtype(compute_dtype) != jnp.float32:
        overrides["dtype"] = getattr(jnp, jnp.dtype(compute_dtype).name)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ConfigError(f"model.path {path} does not exist. Fix: give a GGUF file, a "
                              "Hugging Face folder or a config.json.")
        model, params, tokenizer = from_gguf(path, deployer, param_dtype=dtype,
                                             config_overrides=overrides,
                                             with_tokenizer=model_cfg.tokenizer is None)
        folder = None
    else:
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        config = (path if os.path.isfile(path) else
                  file_in_folder(path, "config.json", "the model's config"))
        if not os.path.isfile(config):
            raise ConfigError(f"model.path {path} is no GGUF file, no config.json and no folder "
                              "holding one. Fix: give a Hugging Face folder, a GGUF file or a "
                              "config.json.")
        if os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path)):
            model, params = from_pretrained(path, deployer, param_dtype=dtype,
                                            config_overrides=overrides)
        else:
            model, params = fresh_model(config, folder, deployer, dtype, overrides)
            deployer.log_info(f"{path} holds no weights: the model starts from random ones "
                              f"(its initialisers, seed deployer.jax_seed={deployer.jax_seed})")
        tokenizer = None
    if model_cfg.tokenizer is not None or tokenizer is None:
        # a folder's own tokenizer.json is the folder's file (not a link out of it); one named
        # by model.tokenizer is the user's choice
        tokenizer = load_tokenizer(model_cfg.tokenizer or file_in_folder(
            folder, "tokenizer.json", "the model's tokenizer"))
    return model, params, tokenizer, model.module_cls.__module__.rsplit(".", 1)[-1]


def fresh_model(config, folder, deployer, dtype, overrides):
    """``(model, params)`` of a config.json, initialised from ``deployer.jax_seed`` and placed
    as from_pretrained places weights (so LoRA's frozen base is split as traced); the
    folder's chat template and generation defaults, where it has them."""
    import json

    from ..models.chat_template import ChatTemplate
    from ..models.pretrained import CHAT_TEMPLATE_FILES, from_reader, read_generation_config

    try:
        with open(config) as f:
            config_dict = json.load(f)
    except ValueError as e:
        raise ConfigError(f"{config} is not JSON ({e}). Fix: give a Hugging Face config.json."
                          ) from None
    model, params = from_reader(config_dict, None, deployer, param_dtype=dtype,
                                config_overrides=overrides, init_seed=deployer.jax_seed)
    for name in CHAT_TEMPLATE_FILES:  # the folder's own files, not links out of it
        file_in_folder(folder, name, "the chat template's source")
    model.chat_template = ChatTemplate.from_folder(folder)
    model.generation_config = read_generation_config(folder)
    return model, params


def load_tokenizer(path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("redcoast train reads tokenizers with the `tokenizers` package. "
                          "Fix: pip install tokenizers") from None
    if not os.path.isfile(path):
        raise ConfigError(f"no tokenizer at {path}. Fix: put the model's tokenizer.json there, "
                          "or give its path as model.tokenizer.")
    return Tokenizer.from_file(path)


def task_of(task, family):
    """The loss for ``family`` (a redcoast.models module name): as asked, or by the family."""
    if task == "auto":
        if family in SEQ2SEQ_FAMILIES:
            return "seq2seq"
        if family in CAUSAL_FAMILIES:
            return "causal_lm"
        raise ConfigError(f"redcoast train fine-tunes causal LMs ({', '.join(CAUSAL_FAMILIES)}) "
                          f"and seq2seq models ({', '.join(SEQ2SEQ_FAMILIES)}), not {family}. "
                          "Fix: write a script with your own loss_fn (README: The three functions).")
    wanted = SEQ2SEQ_FAMILIES if task == "seq2seq" else CAUSAL_FAMILIES
    if family not in wanted:
        raise ConfigError(f"model.task={task} but the model is {family} (it trains as "
                          f"{task_of('auto', family)}). Fix: model.task: auto.")
    return task


def special_tokens(model, tokenizer):
    """The end, padding and decoder-start ids from the model's generation defaults and config
    (the pad: the end token where there is none, else 0)."""
    from .text_task import Tokens

    def first(name):
        for value in ((model.generation_config or {}).get(name), getattr(model.config, name, None)):
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return int(value)
        return None

    eos = first("eos_token_id")
    pad = first("pad_token_id")
    return Tokens(tokenizer, eos=eos, pad=pad if pad is not None else eos if eos is not None else 0,
                  start=first("decoder_start_token_id"))


def make_optimizer(cfg, deployer, train_size):
    """AdamW on the deployer's schedule over the run's updates, clipped where asked."""
    import optax

    o, f = cfg.optimizer, cfg.fit
    schedule = deployer.get_lr_schedule_fn(
        train_size=train_size, per_device_batch_size=f.per_device_batch_size, n_epochs=f.n_epochs,
        learning_rate=o.learning_rate, schedule_type=o.schedule_type, warmup_rate=o.warmup_rate,
        accumulate_grad_batches=cfg.trainer.accumulate_grad_batches, max_steps=f.max_steps)
    optimizer = optax.adamw(schedule, weight_decay=o.weight_decay)
    if o.max_grad_norm is not None:
        optimizer = optax.chain(optax.clip_by_global_norm(o.max_grad_norm), optimizer)
    return optimizer, schedule
