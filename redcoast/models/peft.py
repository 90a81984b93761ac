"""LoRA adapters in Hugging Face PEFT's format, for the models of ``redcoast.models``.

A PEFT folder holds ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors`` with, per adapted module,
``base_model.model.<module>.lora_A.weight`` (rank, in) and ``...lora_B.weight`` (out, rank),
stored as PyTorch's ``nn.Linear`` keeps its weights. For a redcoast kernel ``W`` (in, out) with
adapters ``A`` (in, rank) and ``B`` (rank, out), those are ``A.T`` and ``B.T``; the update is
``alpha / r * B_w @ A_w``, which is ``(alpha / r * A @ B).T``, the same model. GPT-2's Conv1D
modules keep (in, out) weights: PEFT then sets ``fan_in_fan_out``, with the same adapter tensors.
The module names are those of the model's Hugging Face weights (``hf_sources``).

PEFT's other LoRA options map onto :class:`redcoast.lora.LoRA`'s: ``rank_pattern`` and
``alpha_pattern`` (per module, PEFT's first matching key), ``use_rslora``, ``use_dora``
(``<module>.lora_magnitude_vector``, one value per output), and the parameters trained whole:
``modules_to_save`` (``<module>.<param>``; a sequence-classification folder always names its
head) and ``bias`` (``"all"``: every parameter with "bias" in its name, ``"lora_only"``: the
adapted modules' biases, stored as ``<module>.base_layer.bias``).
"""

import json
import math
import os
import re

import numpy as np

from ..errors import ConfigError
from ..lora import (LoRA, _get, _set, adapter_paths, check_adapters, check_pair, path_str,
                    read_safetensors, A_NAME, B_NAME, M_NAME)
from ..store.folder_files import file_in_folder, read_json_object
from ..store.tensor_files import Deferred, entry, host_array, write_safetensors
from .peft_targets import SEQ_CLS_HEADS, check_targets
from .pretrained import family_of

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
TASKS = (("ForCausalLM", "CAUSAL_LM"), ("ForConditionalGeneration", "SEQ_2_SEQ_LM"),
         ("ForSequenceClassification", "SEQ_CLS"), ("ForTokenClassification", "TOKEN_CLS"))
MAGNITUDE = "lora_magnitude_vector"
# LoraConfig fields whose model redcoast's LoRA cannot build: why, for the message
REFUSED = {
    "lora_bias": "a bias on lora_B",
    "target_parameters": "adapters on raw parameters (mixture-of-experts weights)",
    "alora_invocation_tokens": "Activated LoRA, on only after its invocation tokens",
    "layer_replication": "layers repeated to a deeper model",
    "use_qalora": "QALoRA's pooled inputs",
    "trainable_token_indices": "trained embedding rows",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow's routing between adapters",
    "kasa_config": "KaSA's singular-value adapters",
    "monteclora_config": "MonteCLoRA's sampled adapters",
}
# init_lora_weights that change the base weights too: the folder alone is no model
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")
# input embeddings' module names, and the output embeddings' weight a tied model shares them with
EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "shared", "embed_in")
TIED_OUTPUT = "lm_head.weight"


def _params(model):
    """``[(redcoast path, Hugging Face Source, shape)]`` for each parameter of ``model`` kept
    as one tensor in Hugging Face's weights (layers stacked by a scan are left out)."""
    from jax import tree_util

    from . import hf

    family = family_of(model.config.to_hf()["model_type"])
    sources = family.hf_sources(model.config, model.module_cls)
    flat, treedef = tree_util.tree_flatten_with_path(sources, is_leaf=hf.is_source)
    shapes = treedef.flatten_up_to(model.abstract_params())
    out = []
    for (kp, src), abstract in zip(flat, shapes):
        if isinstance(src, hf.Stacked):  # one parameter for every layer's module
            continue
        path = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp)
        out.append((path, src, tuple(abstract.shape)))
    return out


def _modules(model):
    """``{redcoast kernel path str: (Hugging Face module name, stored transposed)}`` for every
    matmul kernel of ``model`` that Hugging Face keeps as a ``<module>.weight``."""
    return {path_str(path): (src.name[:-len(".weight")], bool(src.transpose))
            for path, src, _ in _params(model)
            if path[-1] == "kernel" and src.name.endswith(".weight")}


def _module_kinds(model):
    """``{Hugging Face module name: whether it is a linear layer}`` for the modules of
    :func:`_modules` (a linear layer keeps a 2-D weight; a convolution's has more axes)."""
    from . import hf

    return {src.name[:-len(".weight")]: len(hf.stored_shape(src, shape)) == 2
            for path, src, shape in _params(model)
            if path[-1] == "kernel" and src.name.endswith(".weight")}


def _tied(model, names):
    """Whether ``model`` ties its output embeddings to its input ones (one parameter in
    redcoast; PEFT sees an ``lm_head`` of its own), ``names`` its Hugging Face tensors."""
    return (_task_type(model) in ("CAUSAL_LM", "SEQ_2_SEQ_LM") and TIED_OUTPUT not in names
            and model.config.to_hf().get("tie_word_embeddings", True))


def _embedding(name):
    return len(name.split(".")) > 1 and name.split(".")[-2] in EMBEDDINGS


def _task_type(model):
    name = model.module_cls.__name__
    return next((task for suffix, task in TASKS if name.endswith(suffix)), None)


def save_peft_adapters(model, lora, adapters, folder, *, base_model_name_or_path=None):
    """Write ``adapters`` (made by ``lora`` for ``model``'s params) as a PEFT folder that
    ``peft.PeftModel.from_pretrained(<the transformers model>, folder)`` loads: LoRA pairs, DoRA
    magnitudes and the parameters trained whole. ``base_model_name_or_path`` (default: the
    folder the model was read from, where known) goes into adapter_config.json. Call it on
    every process; process 0 writes."""
    whole = check_adapters(adapters, lora)
    if getattr(model.config, "scan_layers", False):
        raise ConfigError("save_peft_adapters: the model's layers are stacked (scan_layers=True), "
                          "so each adapter holds every layer's, and PEFT's format has one module "
                          "per layer. Fix: save_adapters (redcoast's format), or train with "
                          "scan_layers=False.")
    if lora.stack_dims:
        raise ConfigError(f"save_peft_adapters: LoRA(stack_dims={lora.stack_dims}) adapts stacked "
                          "kernels, which PEFT's format (one module per kernel) cannot hold. Fix: "
                          "save_adapters (redcoast's format) instead.")
    params = {path: (src, shape) for path, src, shape in _params(model)}
    modules = _modules(model)
    entries, names, transposed, ranks, alphas = [], [], set(), {}, {}
    for path in adapter_paths(adapters):
        key = path_str(path)
        if key not in modules:
            raise ConfigError(f"save_peft_adapters: the adapted kernel {key} has no Hugging Face "
                              "module (a matmul stored as <module>.weight). Fix: adapt only the "
                              "model's linear layers, or save_adapters (redcoast's format).")
        module, transpose = modules[key]
        pair = _get(adapters, path)
        check_pair(lora, path, pair, params[tuple(map(str, path))][1])
        names.append(module)
        transposed.add(transpose)
        ranks[module], alphas[module] = lora.rank_of(path), lora.alpha_of(path)
        for name, tensor, keep_first in (("lora_A", pair[A_NAME], False),
                                         ("lora_B", pair[B_NAME], True)):
            entries.append(entry(f"{PREFIX}{module}.{name}.weight",
                                 _as_torch_linear(tensor, keep_first)))
        if M_NAME in pair:
            entries.append(entry(f"{PREFIX}{module}.{MAGNITUDE}", _flat(pair[M_NAME])))
    if len(transposed) > 1:
        raise ConfigError("save_peft_adapters: the adapted modules mix nn.Linear and Conv1D "
                          "weights, and one PEFT config has one fan_in_fan_out. Fix: adapt "
                          "modules of one kind per folder.")
    saved_modules, tied = [], []
    for path in whole:
        if tuple(map(str, path)) not in params:
            raise ConfigError(f"save_peft_adapters: the parameter {path_str(path)}, trained "
                              "whole, has no Hugging Face tensor of its own. Fix: train only the "
                              "model's own parameters whole, or save_adapters (redcoast's format).")
        src, shape = params[tuple(map(str, path))]
        module, param = src.name.rsplit(".", 1)
        stored = f"{module}.base_layer.{param}" if module in names else src.name
        entries.append(entry(PREFIX + stored, _as_stored(src, _get(adapters, path))))
        if _embedding(src.name) and _tied(model, {s.name for s, _ in params.values()}):
            # PEFT ties its lm_head to the trained copy only with ensure_weight_tying
            entries.append(entry(PREFIX + TIED_OUTPUT, _as_stored(src, _get(adapters, path))))
            tied.append(module)
        if lora.in_modules_to_save(path):
            saved_modules.append(module)
        elif not _peft_trains_bias(lora.bias, src.name, names):
            raise ConfigError(f"save_peft_adapters: LoRA(bias={lora.bias!r}) trains "
                              f"{path_str(path)}, which PEFT's bias={lora.bias!r} does not train "
                              f"({src.name}). Fix: name it in modules_to_save too.")
    all_modules = {m for src, _ in params.values() for m in _prefixes(src.name)}
    config = {"peft_type": "LORA", "task_type": _task_type(model), "r": lora.rank,
              "lora_alpha": lora.alpha, "target_modules": _short_or_full(names, modules),
              "lora_dropout": 0.0, "bias": lora.bias, "fan_in_fan_out": transposed == {False},
              "use_rslora": lora.use_rslora, "use_dora": lora.use_dora,
              "modules_to_save": _modules_to_save(sorted(set(saved_modules)), all_modules),
              "inference_mode": True, "init_lora_weights": True,
              "ensure_weight_tying": bool(tied),
              "rank_pattern": _pattern(ranks, lora.rank),
              "alpha_pattern": _pattern(alphas, lora.alpha),
              "base_model_name_or_path": (base_model_name_or_path if base_model_name_or_path
                                          is not None else getattr(model, "name_or_path", None))}
    write_safetensors(os.path.join(folder, WEIGHTS_FILE), entries, metadata={"format": "pt"})
    import jax
    if jax.process_index() == 0:
        tmp = os.path.join(folder, CONFIG_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(config, f, indent=2)
        os.replace(tmp, os.path.join(folder, CONFIG_FILE))


def _short_or_full(names, modules):
    """target_modules: short names ("q_proj") when they select exactly ``names``, as PEFT users
    write them, else the full names."""
    short = sorted({n.rsplit(".", 1)[-1] for n in names})
    chosen = {m for m, _ in modules.values() if m.rsplit(".", 1)[-1] in short}
    return short if chosen == set(names) else sorted(names)


def _modules_to_save(chosen, all_modules):
    """PEFT's modules_to_save for the modules ``chosen``: PEFT wraps every module whose name
    ends with one of them, so short names where they select exactly these, else full ones."""
    if not chosen:
        return None
    for names in (sorted({c.rsplit(".", 1)[-1] for c in chosen}), chosen):
        if {m for m in all_modules if any(m.endswith(n) for n in names)} == set(chosen):
            return names
    raise ConfigError(f"save_peft_adapters: PEFT's modules_to_save selects every module whose "
                      f"name ends with one of its names, and {chosen} select other modules too. "
                      "Fix: train these parameters in adapters of their own, or save_adapters "
                      "(redcoast's format).")


def _pattern(values, default):
    """PEFT's rank_pattern/alpha_pattern for ``{module: value}``: a module's short name where
    every adapted module of that name has the same value, else its full name (escaped: PEFT
    matches keys as regular expressions)."""
    table = {}
    by_short = {}
    for module, value in values.items():
        by_short.setdefault(module.rsplit(".", 1)[-1], {})[module] = value
    for short, group in sorted(by_short.items()):
        if len(set(group.values())) == 1:
            if next(iter(group.values())) != default:
                table[short] = next(iter(group.values()))
        else:
            table.update({re.escape(m): v for m, v in sorted(group.items()) if v != default})
    return table


def _peft_trains_bias(bias, name, adapted):
    """Whether PEFT's ``bias`` option trains the parameter ``name`` (``adapted``: the modules
    holding LoRA adapters)."""
    if bias == "all":
        return "bias" in name
    module, param = name.rsplit(".", 1)
    return bias == "lora_only" and module in adapted and param == "bias"


def _as_torch_linear(tensor, keep_first):
    """A (in..., r) as (r, in) or B (r, out...) as (out, r), fetched when written."""
    shape = np.shape(tensor)
    flat = (shape[0], math.prod(shape[1:])) if keep_first else (math.prod(shape[:-1]), shape[-1])

    def fetch():
        return np.ascontiguousarray(host_array(tensor).reshape(flat).T)
    return Deferred(flat[::-1], np.dtype(tensor.dtype), fetch)


def _flat(tensor):
    """A magnitude (out...) as PEFT's (out,), fetched when written."""
    size = math.prod(np.shape(tensor))
    return Deferred((size,), np.dtype(tensor.dtype),
                    lambda: np.ascontiguousarray(host_array(tensor).reshape(size)))


def _as_stored(src, tensor):
    """A parameter as Hugging Face stores it (``src``: its Source), fetched when written."""
    from . import hf

    stored = hf.stored_shape(src, np.shape(tensor))

    def fetch():
        array = host_array(tensor)
        return np.ascontiguousarray(array.T if src.transpose else array.reshape(stored))
    return Deferred(stored, np.dtype(tensor.dtype), fetch)


def _rank_and_alpha(config, path):
    """``r`` and ``lora_alpha`` as PEFT's LoraConfig takes them (8 and 8 where left out), and
    the rank_pattern and alpha_pattern tables."""
    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{path} has r={rank!r}; the rank is a positive integer. Fix: set r to "
                          "the adapters' rank (lora_A's first dimension).")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ConfigError(f"{path} has lora_alpha={alpha!r}; it is a number (the update is "
                          "scaled by lora_alpha / r). Fix: set it to the alpha trained with.")
    tables = []
    for name in ("rank_pattern", "alpha_pattern"):
        table = config.get(name) or {}
        if not isinstance(table, dict) or not all(isinstance(k, str) for k in table):
            raise ConfigError(f"{path} has {name}={table!r}; it maps module names (regular "
                              "expressions) to values. Fix: save the adapters again "
                              "(peft_model.save_pretrained).")
        try:
            LoRA(**{name: table})  # the values checked as redcoast's LoRA checks its own
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        tables.append(table)
    return rank, float(alpha), tables[0], tables[1]


def _peft_value(table, module, default):
    """PEFT's ``get_pattern_key``: the first key ``k`` with ``re.match(rf"(.*\\.)?({k})$",
    module)`` gives the module's value."""
    return next((v for k, v in table.items() if re.match(rf"(.*\.)?({k})$", module)), default)


def _check_options(config, path):
    refused = [f"{k}={config[k]!r} ({why})" for k, why in REFUSED.items() if config.get(k)]
    if config.get("peft_type", "LORA") != "LORA":
        refused.insert(0, f"peft_type={config.get('peft_type')!r} (not LoRA)")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        refused.append(f"init_lora_weights={init!r} (the base weights were changed too, so the "
                       "adapters fit only that changed base; PEFT's save_pretrained("
                       "path_initial_model_for_weight_conversion=...) converts them to adapters "
                       "of the original base)")
    if config.get("bias", "none") not in ("none", "all", "lora_only"):
        refused.append(f"bias={config['bias']!r} (PEFT's are 'none', 'all', 'lora_only')")
    if refused:
        raise ConfigError(f"{path} uses {'; '.join(refused)}, which redcoast's LoRA cannot "
                          "build. Fix: train the adapters without those options (or convert "
                          "them as said).")


def load_peft_adapters(folder, model, params=None):
    """``(lora, adapters)`` from a PEFT LoRA folder for ``model``: adapters in redcoast's layout
    (numpy), for ``lora.merge(params, adapters)`` or a Trainer, with the parameters PEFT trained
    whole (modules_to_save, bias) in place. ``params`` (the base, optional) gives the kernels'
    shapes (by default the model's own)."""
    path = file_in_folder(folder, CONFIG_FILE, "the PEFT adapter's config")
    if not os.path.exists(path):
        raise ConfigError(f"{folder} has no {CONFIG_FILE}. Fix: pass a folder PEFT wrote "
                          "(peft_model.save_pretrained) or save_peft_adapters did.")
    config = read_json_object(path, "save the PEFT adapters again (peft_model.save_pretrained)")
    _check_options(config, path)
    rank, alpha, rank_pattern, alpha_pattern = _rank_and_alpha(config, path)
    weights_path = file_in_folder(folder, WEIGHTS_FILE, "the PEFT adapter's weights")
    tensors = read_safetensors(weights_path, "save the PEFT adapters again")
    hf_params = {src.name: (p, src, shape) for p, src, shape in _params(model)}
    by_module = {m: tuple(p.split("/")) for p, (m, _) in _modules(model).items()}
    parts, whole, unknown, tied_copy = {}, {}, [], None
    for key in sorted(tensors):
        name = key[len(PREFIX):] if key.startswith(PREFIX) else None
        pair = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.weight|(.+)\.lora_magnitude_vector(\.weight)?",
                            name or "")
        if pair and (pair.group(1) or pair.group(3)) in by_module:
            module = pair.group(1) or pair.group(3)
            parts.setdefault(module, {})[pair.group(2) or MAGNITUDE] = tensors[key]
        elif name is not None and name.replace(".base_layer.", ".") in hf_params:
            whole[name.replace(".base_layer.", ".")] = tensors[key]
        elif name == TIED_OUTPUT and _tied(model, hf_params):
            tied_copy = tensors[key]
        else:
            unknown.append(key)
    if unknown:
        raise ConfigError(f"{folder}/{WEIGHTS_FILE} holds tensors that are no LoRA adapter or "
                          f"parameter of a {model.module_cls.__name__}: {unknown[:4]}. Fix: load "
                          "adapters trained for this model (its Hugging Face class and config).")
    # PEFT adapts the modules target_modules names and fills them from the weights
    check_targets(config, _module_kinds(model), set(parts), weights_path, path)
    _check_whole(config, whole, set(parts), weights_path, path)
    if _tied(model, hf_params):
        _check_tied(config, whole, tied_copy, weights_path, path)
    adapters = {}
    for module, held in sorted(parts.items()):
        kernel_path = by_module[module]
        shape = (np.shape(_get(params, kernel_path)) if params is not None
                 else hf_params[module + ".weight"][2])
        r = _peft_value(rank_pattern, module, rank)
        _set(adapters, kernel_path, _pair(held, r, shape, bool(config.get("use_dora")),
                                          f"{folder}/{WEIGHTS_FILE}", module))
    for name, tensor in whole.items():
        p, src, shape = hf_params[name]
        _set(adapters, p, _from_stored(src, tensor, shape, f"{folder}/{WEIGHTS_FILE}"))
    return _lora_for(config, rank, alpha, rank_pattern, alpha_pattern, by_module, parts,
                     [hf_params[n][0] for n in whole]), adapters


def _pair(held, rank, shape, dora, where, module):
    """One module's PEFT tensors (``lora_A`` (r, in), ``lora_B`` (out, r), the magnitude
    (out,)) as redcoast's adapter of a kernel of ``shape`` (in, out...)."""
    missing = [n for n in ("lora_A", "lora_B") + ((MAGNITUDE,) if dora else ()) if n not in held]
    if missing or (MAGNITUDE in held and not dora):
        raise ConfigError(f"{where} has {sorted(held)} for {module}" + (
            f", without {missing}" if missing else ", a DoRA magnitude while use_dora is off") +
            ". Fix: save the PEFT adapters again (peft_model.save_pretrained).")
    a, b = held["lora_A"], held["lora_B"]
    out = math.prod(shape[1:])
    if a.shape != (rank, shape[0]) or b.shape != (out, rank):
        raise ConfigError(f"{where}: {module} has lora_A {a.shape}, lora_B {b.shape}, not "
                          f"(r={rank}, {shape[0]}) and ({out}, r={rank}). Fix: check r and "
                          f"rank_pattern in {CONFIG_FILE}.")
    pair = {A_NAME: np.ascontiguousarray(a.T),
            B_NAME: np.ascontiguousarray(b.T.reshape(rank, *shape[1:]))}
    if dora:
        m = held[MAGNITUDE]
        if m.shape != (out,):
            raise ConfigError(f"{where}: {module}'s {MAGNITUDE} has shape {m.shape}, not ({out},) "
                              "(one value per output). Fix: save the PEFT adapters again.")
        pair[M_NAME] = m.reshape(shape[1:])
    return pair


def _from_stored(src, tensor, shape, where):
    from . import hf

    if tensor.shape != hf.stored_shape(src, shape):
        raise ConfigError(f"{where}: {src.name} has shape {tensor.shape}, the model's is "
                          f"{hf.stored_shape(src, shape)}. Fix: load adapters trained for this "
                          "model (its Hugging Face config).")
    return np.ascontiguousarray(tensor.T if src.transpose else tensor.reshape(shape))


def _check_whole(config, whole, adapted, weights_file, config_file):
    """Each whole parameter the weights hold is one PEFT trains: its module in
    ``modules_to_save`` (a sequence classifier's head always is), or a bias by ``bias``."""
    saved = list(config.get("modules_to_save") or [])
    if config.get("task_type") in ("SEQ_CLS", "TOKEN_CLS"):  # PEFT adds the heads to train
        saved += SEQ_CLS_HEADS
    bias = config.get("bias", "none")
    stray = [n for n in sorted(whole) if not _peft_trains_bias(bias, n, adapted)
             and not any(m.endswith(t) for t in saved for m in _prefixes(n))]
    if stray:
        raise ConfigError(f"{weights_file} holds {stray[:4]}, which {config_file} does not train "
                          f"(bias={bias!r}, modules_to_save={config.get('modules_to_save')!r}): "
                          "PEFT would load them into the base model, a model its config does not "
                          "describe. Fix: save the adapters again (peft_model.save_pretrained).")


def _check_tied(config, whole, tied_copy, weights_file, config_file):
    """A model whose output embeddings are its input ones: PEFT's trained embedding is the
    output one too only with ensure_weight_tying (its lm_head then holds the same copy)."""
    embeddings = [n for n in whole if _embedding(n)]
    if tied_copy is not None and not any(np.array_equal(tied_copy, whole[n]) for n in embeddings):
        raise ConfigError(f"{weights_file} holds a trained {TIED_OUTPUT} that differs from the "
                          "input embeddings, and the model ties the two (one parameter in "
                          "redcoast). Fix: save the adapters again (peft_model.save_pretrained) "
                          "from a model trained with LoraConfig(ensure_weight_tying=True).")
    if embeddings and tied_copy is None and not config.get("ensure_weight_tying"):
        raise ConfigError(f"{weights_file} holds trained input embeddings ({embeddings[0]}) of a "
                          "model that ties them to its output ones, and "
                          f"{config_file} has ensure_weight_tying off: PEFT then uses the trained "
                          "copy for the input only and the original for the output, which "
                          "redcoast's one shared parameter cannot be. Fix: train with "
                          "LoraConfig(ensure_weight_tying=True), which trains one copy for "
                          "both.")


def _prefixes(name):
    """The modules a parameter ``name`` lies in: "a.b.weight" -> "a", "a.b"."""
    pieces = name.split(".")
    return [".".join(pieces[:i]) for i in range(1, len(pieces))]


def _lora_for(config, rank, alpha, rank_pattern, alpha_pattern, by_module, parts, whole):
    """The LoRA of a PEFT folder: per-kernel patterns (exact paths) where a module's rank or
    alpha differs from r and lora_alpha; the parameters trained whole that PEFT's bias rule
    takes and redcoast's would not (their names differ) named in modules_to_save."""
    kernels = {path_str(by_module[m]): m for m in parts}
    ranks = {f"^{re.escape(k)}$": _peft_value(rank_pattern, m, rank) for k, m in kernels.items()}
    alphas = {f"^{re.escape(k)}$": _peft_value(alpha_pattern, m, alpha)
              for k, m in kernels.items()}
    bias = config.get("bias", "none")
    plain = LoRA(rank=rank, bias=bias)
    modules = {by_module[m][:-1] for m in parts}
    saved = [f"^{re.escape(path_str(p))}$" for p in whole
             if not (bias != "none" and plain.trains_whole(p, modules))]
    return LoRA(rank=rank, alpha=alpha,
                targets=tuple(f"(^|/){k}$" for k in kernels) or ".",
                rank_pattern={k: v for k, v in ranks.items() if v != rank},
                alpha_pattern={k: float(v) for k, v in alphas.items() if v != alpha},
                use_rslora=bool(config.get("use_rslora")), use_dora=bool(config.get("use_dora")),
                modules_to_save=tuple(saved) or None, bias=bias)
