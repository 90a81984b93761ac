"""LoRA adapters in Hugging Face PEFT's format, for the models of ``redcoast.models``.

A PEFT folder holds ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors`` with, per adapted module,
``base_model.model.<module>.lora_A.weight`` (rank, in) and ``...lora_B.weight`` (out, rank),
stored as PyTorch's ``nn.Linear`` keeps its weights. For a redcoast kernel ``W`` (in, out) with
adapters ``A`` (in, rank) and ``B`` (rank, out), those are ``A.T`` and ``B.T``; the update is
``alpha / r * B_w @ A_w``, which is ``(alpha / r * A @ B).T``, the same model. GPT-2's Conv1D
modules keep (in, out) weights: PEFT then sets ``fan_in_fan_out``, with the same adapter tensors.
The module names are those of the model's Hugging Face weights (``hf_sources``).
"""

import json
import math
import os

import numpy as np

from ..errors import ConfigError
from ..lora import LoRA, _check_pairs, _get, _set, adapter_paths, path_str, read_safetensors
from ..tensor_files import Deferred, entry, host_array, write_safetensors
from ..folder_files import file_in_folder, read_json_object
from .peft_targets import check_targets
from .pretrained import family_of

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
TASKS = (("ForCausalLM", "CAUSAL_LM"), ("ForConditionalGeneration", "SEQ_2_SEQ_LM"),
         ("ForSequenceClassification", "SEQ_CLS"), ("ForTokenClassification", "TOKEN_CLS"))


def _modules(model):
    """``{redcoast kernel path str: (Hugging Face module name, stored transposed)}`` for every
    matmul kernel of ``model`` that Hugging Face keeps as a ``<module>.weight``."""
    from jax import tree_util

    from . import hf

    family = family_of(model.config.to_hf()["model_type"])
    sources = family.hf_sources(model.config, model.module_cls)
    out = {}
    for kp, src in tree_util.tree_flatten_with_path(sources, is_leaf=hf.is_source)[0]:
        if isinstance(src, hf.Stacked):  # one parameter for every layer's module
            continue
        path = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp)
        if path.endswith("/kernel") and src.name.endswith(".weight"):
            out[path] = (src.name[:-len(".weight")], bool(src.transpose))
    return out


def _module_kinds(model):
    """``{Hugging Face module name: whether it is a linear layer}`` for the modules of
    :func:`_modules` (a linear layer keeps a 2-D weight; a convolution's has more axes)."""
    from jax import tree_util

    from . import hf

    family = family_of(model.config.to_hf()["model_type"])
    sources = family.hf_sources(model.config, model.module_cls)
    flat, treedef = tree_util.tree_flatten_with_path(sources, is_leaf=hf.is_source)
    shapes = treedef.flatten_up_to(model.abstract_params())
    modules = _modules(model)
    kinds = {}
    for (kp, src), abstract in zip(flat, shapes):
        path = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp)
        if path in modules:
            kinds[modules[path][0]] = len(hf.stored_shape(src, abstract.shape)) == 2
    return kinds


def _task_type(model):
    name = model.module_cls.__name__
    return next((task for suffix, task in TASKS if name.endswith(suffix)), None)


def save_peft_adapters(model, lora, adapters, folder):
    """Write ``adapters`` (made by ``lora`` for ``model``'s params) as a PEFT folder that
    ``peft.PeftModel.from_pretrained(<the transformers model>, folder)`` loads. Call it on every
    process; process 0 writes."""
    _check_pairs(adapters)
    if getattr(model.config, "scan_layers", False):
        raise ConfigError("save_peft_adapters: the model's layers are stacked (scan_layers=True), "
                          "so each adapter holds every layer's, and PEFT's format has one module "
                          "per layer. Fix: save_adapters (redcoast's format), or train with "
                          "scan_layers=False.")
    if lora.stack_dims:
        raise ConfigError(f"save_peft_adapters: LoRA(stack_dims={lora.stack_dims}) adapts stacked "
                          "kernels, which PEFT's format (one module per kernel) cannot hold. Fix: "
                          "save_adapters (redcoast's format) instead.")
    modules = _modules(model)
    entries, names, transposed = [], [], set()
    for path in adapter_paths(adapters):
        key = path_str(path)
        if key not in modules:
            raise ConfigError(f"save_peft_adapters: the adapted kernel {key} has no Hugging Face "
                              "module (a matmul stored as <module>.weight). Fix: adapt only the "
                              "model's linear layers, or save_adapters (redcoast's format).")
        module, transpose = modules[key]
        names.append(module)
        transposed.add(transpose)
        pair = _get(adapters, path)
        for name, tensor, keep_first in (("lora_A", pair["lora_a"], False),
                                         ("lora_B", pair["lora_b"], True)):
            entries.append(entry(f"{PREFIX}{module}.{name}.weight", _as_torch_linear(tensor, keep_first)))
    if len(transposed) > 1:
        raise ConfigError("save_peft_adapters: the adapted modules mix nn.Linear and Conv1D "
                          "weights, and one PEFT config has one fan_in_fan_out. Fix: adapt "
                          "modules of one kind per folder.")
    short = sorted({n.rsplit(".", 1)[-1] for n in names})
    # short names ("q_proj") when they select exactly these modules, as PEFT users write them
    chosen = {m for m, _ in modules.values() if m.rsplit(".", 1)[-1] in short}
    targets = short if chosen == set(names) else sorted(names)
    config = {"peft_type": "LORA", "task_type": _task_type(model), "r": lora.rank,
              "lora_alpha": lora.alpha, "target_modules": targets, "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": transposed == {False}, "use_rslora": False,
              "use_dora": False, "modules_to_save": None, "inference_mode": True,
              "init_lora_weights": True, "rank_pattern": {}, "alpha_pattern": {},
              "base_model_name_or_path": None}
    write_safetensors(os.path.join(folder, WEIGHTS_FILE), entries, metadata={"format": "pt"})
    import jax
    if jax.process_index() == 0:
        tmp = os.path.join(folder, CONFIG_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(config, f, indent=2)
        os.replace(tmp, os.path.join(folder, CONFIG_FILE))


def _as_torch_linear(tensor, keep_first):
    """A (in..., r) as (r, in) or B (r, out...) as (out, r), fetched when written."""
    shape = np.shape(tensor)
    flat = (shape[0], math.prod(shape[1:])) if keep_first else (math.prod(shape[:-1]), shape[-1])

    def fetch():
        return np.ascontiguousarray(host_array(tensor).reshape(flat).T)
    return Deferred(flat[::-1], np.dtype(tensor.dtype), fetch)


def _rank_and_alpha(config, path):
    """``r`` and ``lora_alpha`` as PEFT's LoraConfig takes them (8 and 8 where left out)."""
    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{path} has r={rank!r}; the rank is a positive integer. Fix: set r to "
                          "the adapters' rank (lora_A's first dimension).")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ConfigError(f"{path} has lora_alpha={alpha!r}; it is a number (the update is "
                          "scaled by lora_alpha / r). Fix: set it to the alpha trained with.")
    return rank, float(alpha)


def load_peft_adapters(folder, model, params=None):
    """``(lora, adapters)`` from a PEFT LoRA folder for ``model``: adapters in redcoast's layout
    (numpy), for ``lora.merge(params, adapters)`` or a Trainer. ``params`` (the base, optional)
    gives the kernels' shapes for kernels with more than two axes."""
    path = file_in_folder(folder, CONFIG_FILE, "the PEFT adapter's config")
    if not os.path.exists(path):
        raise ConfigError(f"{folder} has no {CONFIG_FILE}. Fix: pass a folder PEFT wrote "
                          "(peft_model.save_pretrained) or save_peft_adapters did.")
    config = read_json_object(path, "save the PEFT adapters again (peft_model.save_pretrained)")
    unsupported = [f"{k}={config[k]!r}" for k in ("use_dora", "rank_pattern", "alpha_pattern",
                                                  "modules_to_save", "lora_bias",
                                                  "target_parameters")
                   if config.get(k)]
    if config.get("peft_type", "LORA") != "LORA":
        unsupported.insert(0, f"peft_type={config.get('peft_type')!r}")
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config['bias']!r}")
    if unsupported:
        raise ConfigError(f"{path} uses {', '.join(unsupported)}, which redcoast's LoRA cannot "
                          "represent (one rank and alpha for every kernel, plain A @ B updates, "
                          "no trained biases or whole modules). Fix: train the adapters without "
                          "those options.")
    rank, alpha = _rank_and_alpha(config, path)
    if config.get("use_rslora"):  # scale alpha / sqrt(r): the same as alpha * sqrt(r) / r
        alpha *= math.sqrt(rank)
    weights_path = file_in_folder(folder, WEIGHTS_FILE, "the PEFT adapter's weights")
    tensors = read_safetensors(weights_path, "save the PEFT adapters again")
    by_module = {m: (p, t) for p, (m, t) in _modules(model).items()}
    adapters, unknown, held = {}, [], set()
    for key in sorted(tensors):
        for name, ours in (("lora_A", "lora_a"), ("lora_B", "lora_b")):
            suffix = f".{name}.weight"
            if key.startswith(PREFIX) and key.endswith(suffix):
                module = key[len(PREFIX):-len(suffix)]
                if module not in by_module:
                    unknown.append(key)
                    break
                held.add(module)
                kernel_path = tuple(by_module[module][0].split("/"))
                _set(adapters, kernel_path + (ours,), tensors[key])
                break
        else:
            unknown.append(key)
    if unknown:
        raise ConfigError(f"{folder}/{WEIGHTS_FILE} holds tensors that are no LoRA adapter of a "
                          f"{model.module_cls.__name__} module: {unknown[:4]}. Fix: load adapters "
                          "trained for this model (its Hugging Face class and config).")
    # PEFT adapts the modules target_modules names and fills them from the weights
    check_targets(config, _module_kinds(model), held, weights_path, path)
    lora = LoRA(rank=rank, alpha=alpha, targets=tuple(
        f"(^|/){path_str(p)}$" for p in adapter_paths(adapters)) or ".")
    for kernel_path in adapter_paths(adapters):
        pair = _get(adapters, kernel_path)
        if set(pair) != {"lora_a", "lora_b"}:
            raise ConfigError(f"{folder}/{WEIGHTS_FILE} has only {sorted(pair)} for "
                              f"{path_str(kernel_path)}. Fix: save the PEFT adapters again.")
        a, b = pair["lora_a"], pair["lora_b"]  # (r, in), (out, r)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ConfigError(f"{folder}: {path_str(kernel_path)} has lora_A {a.shape}, lora_B "
                              f"{b.shape}, not (r={rank}, in) and (out, r={rank}). Fix: check r in "
                              f"{CONFIG_FILE}.")
        a, b = a.T, b.T
        if params is not None:
            shape = np.shape(_get(params, kernel_path))
            a, b = a.reshape(*shape[:1], rank), b.reshape(rank, *shape[1:])
        _set(adapters, kernel_path, {"lora_a": np.ascontiguousarray(a),
                                     "lora_b": np.ascontiguousarray(b)})
    return lora, adapters
