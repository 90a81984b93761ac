"""Values of a run record (redcoast/cli/run_config.py) that no run can mean, refused before any work.

The record's types are draccus's to check; these are the values of the right type that still
cannot be what was meant: ``data.max_length: 0`` trains on nothing (loss 0, exit status 0), a
negative learning rate climbs the loss for a whole run, a batch of no examples or an interval
of 0 updates has no meaning. Each problem is named by its YAML path, with the value and the fix:

    data.max_length: 0 cuts every sequence to no token, so nothing is trained (loss 0). Fix: ...

A learning rate of 0 is allowed (a run that keeps its parameters measures speed or checks a
pipeline); ``warmup_rate`` above 1 (a warmup longer than the run, so the peak rate is never
reached) is not.
"""

import difflib
import math
import re

from ..errors import ConfigError
from ..validate import is_integer


def check_values(cfg) -> None:
    """Raise one :class:`ConfigError` listing every value of ``cfg`` (a RunConfig) no run can
    mean, each with its YAML path, the value and the fix; nothing when there is none."""
    found = problems(cfg)
    if found:
        raise ConfigError("the run config holds "
                          + ("a value" if len(found) == 1 else f"{len(found)} values")
                          + " no run can mean:\n  " + "\n  ".join(found))


def problems(cfg) -> list:
    """One line per value of ``cfg`` no run can mean (see :func:`check_values`)."""
    d, t, f, o, lo = cfg.deployer, cfg.trainer, cfg.fit, cfg.optimizer, cfg.lora
    out = []

    def need(ok, path, value, why, fix):
        if not ok:
            out.append(f"{path}: {value!r} {why}. Fix: set {path} to {fix}.")

    def count(path, value, what, fix, optional=False, because=""):
        """``value`` a positive integer (or None where ``optional``)."""
        if optional and value is None:
            return
        need(is_integer(value) and value >= 1, path, value,
             f"is not a positive number of {what}{because}", fix)

    # the data: every sequence cut to max_length tokens
    count("data.max_length", cfg.data.max_length, "tokens",
          "the longest sequence to train on, in tokens (default 512)",
          because=": every sequence would be cut to nothing, so the run would train on nothing "
                  "(loss 0)")
    # how much is trained, and in what steps
    count("fit.per_device_batch_size", f.per_device_batch_size, "examples",
          "the examples each device takes per micro-batch, e.g. 8")
    count("fit.eval_per_device_batch_size", f.eval_per_device_batch_size, "examples",
          "the examples each device evaluates at a time, or null for fit.per_device_batch_size",
          optional=True)
    count("trainer.accumulate_grad_batches", t.accumulate_grad_batches, "micro-batches",
          "the micro-batches summed into one update, 1 for none")
    if f.n_epochs is None:
        need(f.max_steps is not None, "fit.n_epochs", None,
             "sets no length of the run and fit.max_steps sets none either",
             "the number of passes over data.train (e.g. 1), or fit.max_steps")
    else:
        count("fit.n_epochs", f.n_epochs, "passes over the data", "1 or more",
              because=": the run would train nothing")
    count("fit.max_steps", f.max_steps, "updates",
          "the number of optimizer updates to train for, or null to train fit.n_epochs",
          optional=True)
    # how often things happen
    for name, what in (("save_every_n_steps", "updates"), ("save_every_k_epochs", "epochs"),
                       ("eval_every_n_steps", "updates")):
        count(f"fit.{name}", getattr(f, name), what,
              "a positive interval, or null for none", optional=True)
    count("fit.log_every_n_steps", f.log_every_n_steps, "updates",
          "a positive interval, e.g. 10")
    count("fit.keep_last_n_ckpts", f.keep_last_n_ckpts, "checkpoints",
          "1 or more, or null to keep them all", optional=True,
          because=": each save would delete the one before, the preemption save included")
    data = cfg.data
    need(f.eval_every_n_steps is None or data.eval is not None or data.eval_fraction is not None,
         "fit.eval_every_n_steps", f.eval_every_n_steps,
         "asks for evaluations but neither data.eval nor data.eval_fraction gives eval data",
         "null, or set data.eval to a file of examples (or data.eval_fraction)")
    out.extend(data_problems(cfg))
    # the optimizer
    need(_finite(o.learning_rate) and o.learning_rate >= 0, "optimizer.learning_rate",
         o.learning_rate, "is not a learning rate: a negative one climbs the loss instead of "
         "descending it", "a positive rate, e.g. 1e-4 (0 keeps the parameters as they are)")
    need(_finite(o.weight_decay) and o.weight_decay >= 0, "optimizer.weight_decay",
         o.weight_decay, "is not a weight decay: a negative one grows the weights each update",
         "0 for none, or a positive factor such as 0.01")
    need(_finite(o.warmup_rate) and 0 <= o.warmup_rate <= 1, "optimizer.warmup_rate",
         o.warmup_rate, "is not a fraction of the run's updates"
         + (": the warmup would last longer than the run, so the learning rate would never reach "
            "optimizer.learning_rate" if _finite(o.warmup_rate) and o.warmup_rate > 1 else ""),
         "a fraction between 0 (no warmup) and 1, e.g. 0.1 for the first tenth of the updates")
    from ..schedules import SCHEDULE_TYPES
    need(o.schedule_type in SCHEDULE_TYPES, "optimizer.schedule_type", o.schedule_type,
         "is not a schedule" + did_you_mean(o.schedule_type, SCHEDULE_TYPES),
         f"one of {', '.join(SCHEDULE_TYPES)}")
    need(o.max_grad_norm is None or (_finite(o.max_grad_norm) and o.max_grad_norm > 0),
         "optimizer.max_grad_norm", o.max_grad_norm,
         "is not a gradient norm to clip to (0 or less would zero every update)",
         "a positive norm such as 1.0, or null for no clipping")
    # LoRA
    need(is_integer(lo.rank) and lo.rank >= 0, "lora.rank", lo.rank, "is not a rank",
         "0 to train the whole model, or the adapters' rank, e.g. 8")
    if is_integer(lo.rank) and lo.rank > 0:
        need(_finite(lo.alpha) and lo.alpha > 0, "lora.alpha", lo.alpha,
             "is not a LoRA scale: the adapters' output is multiplied by alpha / rank, so 0 "
             "trains nothing and a negative one flips it", "a positive scale, e.g. 16")
        try:
            re.compile(lo.targets)
        except re.error as e:
            need(False, "lora.targets", lo.targets, f"is not a regular expression ({e})",
                 "a Python regular expression matching the kernels to adapt")
    need(lo.save == "merged" or not is_integer(lo.rank) or lo.rank > 0, "lora.save", lo.save,
         "asks for a PEFT adapter folder, but lora.rank is 0 (the whole model is trained)",
         "merged, or lora.rank to the adapters' rank, e.g. 8")
    need(lo.save == "merged" or not lo.rank or cfg.export is not None, "lora.save", lo.save,
         "asks for a PEFT adapter folder, but export names no folder to write it to",
         "merged, or export to the folder the adapters go to")
    # dtypes and devices
    for path, name in (("trainer.compute_dtype", t.compute_dtype),
                       ("model.param_dtype", cfg.model.param_dtype)):
        need(_is_dtype(name), path, name, "is not a dtype name",
             "'float32', 'bfloat16' or 'float16'")
    need(t.eval_by in (None, "example", "batch"), "trainer.eval_by", t.eval_by,
         "is not a way to evaluate",
         "'example', 'batch', or null (decided at the first evaluation)")
    need(d.n_model_shards == "auto" or (is_integer(d.n_model_shards) and d.n_model_shards >= 1),
         "deployer.n_model_shards", d.n_model_shards, "is not a number of model shards",
         "a positive number dividing the devices, or 'auto'")
    for name, what in (("n_processes", "processes"), ("n_local_devices", "devices"),
                       ("memory_budget_bytes", "bytes")):
        count(f"deployer.{name}", getattr(d, name), what,
              "a positive number, or null to find it out", optional=True)
    count("simulate_cpu_devices", cfg.simulate_cpu_devices, "devices",
          "a positive number of CPU devices to simulate, or null for the machine's own",
          optional=True)
    return out


def data_problems(cfg) -> list:
    """The data section's: a held-out share, and the formats and packing the task can take."""
    d, out = cfg.data, []

    def need(ok, path, value, why, fix):
        if not ok:
            out.append(f"{path}: {value!r} {why}. Fix: set {path} to {fix}.")

    if d.eval_fraction is not None:
        share = _finite(d.eval_fraction) and 0 < d.eval_fraction < 1
        need(share, "data.eval_fraction", d.eval_fraction,
             "is not a share of the training records to hold out",
             "a fraction between 0 and 1, e.g. 0.1, or null for none")
        need(not share or d.eval is None, "data.eval_fraction", d.eval_fraction,
             f"holds out training records, but data.eval already names eval data ({d.eval})",
             "null, or data.eval to null")
    need(is_integer(d.split_seed) and d.split_seed >= 0, "data.split_seed", d.split_seed,
         "is not a seed", "a number 0 or above")
    seq2seq = cfg.model.task == "seq2seq"
    need(not (seq2seq and d.format in ("messages", "text")), "data.format", d.format,
         "is not a seq2seq format (a source and a target), and model.task is seq2seq",
         "prompt_completion, or model.task to causal_lm")
    need(not (seq2seq and d.packing), "data.packing", d.packing,
         "packs sequences into rows of a causal LM's tokens, and model.task is seq2seq",
         "false, or model.task to causal_lm")
    return out


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_dtype(name) -> bool:
    import jax.numpy as jnp  # starts no backend (simulate_cpu_devices comes after the checks)
    try:
        jnp.dtype(name)
    except TypeError:
        return False
    return True


def did_you_mean(key, choices, prefix="", rest="") -> str:
    """`` (did you mean <prefix><closest><rest>?)`` for the closest of ``choices``, or ''."""
    close = difflib.get_close_matches(str(key), list(choices), n=1)
    return f" (did you mean {prefix}{close[0]}{rest}?)" if close else ""
