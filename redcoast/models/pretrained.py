"""``from_pretrained`` / ``save_pretrained`` for every model family in redcoast.models.

A family is a module (``redcoast.models.llama``, ...) that provides:

- ``Config``: a dataclass with ``Config.from_hf(dict)`` and ``config.to_hf() -> dict`` (the
  Hugging Face config.json, ``model_type`` and ``architectures`` included);
- ``MODULES``: {Hugging Face architecture name: NNX module class}, and ``DEFAULT_MODULE``;
- ``hf_sources(config, module_cls)``: a pytree of :class:`redcoast.models.hf.Source` mirroring
  ``Model(module_cls, config).abstract_params()``: which stored tensor fills each parameter;
- ``example_inputs(config, module_cls)``: abstract positional inputs of the module's
  ``__call__`` (``jax.ShapeDtypeStruct``), traced to derive the sharding plan.

and optionally:

- ``TASK_HEADS``: {module class: top-level parameter names of its task head}; a checkpoint
  without them (a base model loaded for a new task) gets them freshly initialised, and logged;
- ``UNUSED_OK``: regexes of stored tensors that are never parameters (buffers such as BERT's
  ``position_ids``), left out of the unused-tensor report.
"""

import dataclasses
import importlib
import json
import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError
from ..sharding.paths import key_to_str
from ..store.folder_files import file_in_folder
from ..store.tensor_files import Deferred, host_array, host_row
from . import folder_extras
from . import hf
from .base import Model
from .chat_template import ChatTemplate

CHAT_TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")

# model_type in config.json -> the family module that reads it
FAMILIES = {
    "llama": "redcoast.models.llama",
    "mistral": "redcoast.models.llama",
    "qwen2": "redcoast.models.llama",
    "gpt2": "redcoast.models.gpt2",
    "bert": "redcoast.models.bert",
    "t5": "redcoast.models.t5",
    "gptj": "redcoast.models.gptj",
    "opt": "redcoast.models.opt",
    "bart": "redcoast.models.bart",
    "vit": "redcoast.models.vit",
    "vision-encoder-decoder": "redcoast.models.vision_encoder_decoder",
}


def family_of(model_type):
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not supported; redcoast.models reads "
                          f"{sorted(FAMILIES)}.")
    return importlib.import_module(FAMILIES[model_type])


def module_class(family, config_dict, architecture=None):
    names = [architecture] if architecture else list(config_dict.get("architectures") or [])
    for name in names:
        if name in family.MODULES:
            return family.MODULES[name]
    if architecture:
        raise ConfigError(f"architecture {architecture!r} is not one of {sorted(family.MODULES)}")
    return family.DEFAULT_MODULE


def from_pretrained(folder, deployer=None, *, shardings=None, param_dtype=jnp.float32,
                    architecture=None, fsdp=False, config_overrides=None, rng=None):
    """``(model, params)`` from a local Hugging Face folder (config.json + safetensors).

    With a ``deployer``, each parameter is placed straight into its shards on the deployer's
    mesh by the plan traced from the model's forward pass (the plan the Trainer would choose;
    ``fsdp=True`` also splits over 'dp'); each device reads only its slice of each tensor.
    Without one, everything goes to the first local device. ``config_overrides`` replaces
    fields of the parsed config (e.g. ``{"remat": True, "dtype": jnp.bfloat16}``) or, for keys
    that are not fields, of config.json (e.g. ``{"num_labels": 1}``).

    ``architecture`` may name a task model whose head the checkpoint lacks (e.g.
    ``"BertForSequenceClassification"`` from a ``BertModel`` folder): the head is initialised
    fresh with the architecture's own initialisers from ``rng`` (a PRNG key or an int seed;
    default: the deployer's next key, else key 0) and the log names every such parameter.
    Stored tensors the architecture does not use are logged too. A missing parameter outside
    the head, or a tensor whose shape disagrees with the config, is an error.
    """
    # the small files first: a folder refused for them is refused before its weights are read
    generation_config = read_generation_config(folder)
    for name in CHAT_TEMPLATE_FILES:  # ChatTemplate.from_folder reads them by name
        file_in_folder(folder, name, "the chat template's source")
    chat_template = ChatTemplate.from_folder(folder)
    model, params = from_reader(hf.read_config(folder), hf.SafetensorsFolder(folder), deployer,
                                shardings=shardings, param_dtype=param_dtype,
                                architecture=architecture, fsdp=fsdp,
                                config_overrides=config_overrides, rng=rng)
    model.generation_config = generation_config
    model.chat_template = chat_template
    model.name_or_path = str(folder)
    return model, params


def read_generation_config(folder):
    """The folder's ``generation_config.json`` as a dict (generation's defaults: EOS, pad, ...),
    or ``{}`` where it has none."""
    path = file_in_folder(folder, "generation_config.json", "the generation defaults")
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON ({e}). Fix: repair or delete it (it "
                          "only holds generation defaults).") from None
    return value if isinstance(value, dict) else {}


def parse_config(family, config_dict, reader, config_overrides=None):
    """The family's config from ``config_dict``, with ``config_overrides`` applied: dataclass
    fields replaced after parsing, other keys (Hugging Face names) set before it; a key that
    changes nothing and is no setting of the family's config is an error."""
    config_overrides = dict(config_overrides or {})
    fields = {f.name for f in dataclasses.fields(family.Config)}
    as_hf = {k: v for k, v in config_overrides.items() if k not in fields}
    parsed = family.Config.from_hf(config_dict)
    config = parsed
    if as_hf:
        config_dict = {**config_dict, **as_hf}
        if "num_labels" in as_hf:  # as in transformers: num_labels replaces the stored label names
            config_dict = {k: v for k, v in config_dict.items()
                           if k not in ("id2label", "label2id")}
        config = family.Config.from_hf(config_dict)
    for key, value in as_hf.items():  # a key the family does not read must not pass unnoticed
        if getattr(config, key, object()) != value and config == parsed:
            raise ConfigError(f"config_overrides[{key!r}] = {value!r} did not take effect: "
                              f"{family.Config.__module__}.Config has no such setting. Use one of "
                              f"{sorted(fields)} or a config.json key it reads.")
    if reader is not None and hasattr(family, "config_for_tensors"):  # when config.json alone
        # does not say (T5's lm_head); without tensors (planning), config.json is taken as it is
        config = family.config_for_tensors(config, reader)
    return dataclasses.replace(config, **{k: v for k, v in config_overrides.items() if k in fields})


def model_from_config(config, *, param_dtype=jnp.float32, architecture=None,
                      config_overrides=None):
    """``(model, abstract params)`` from a Hugging Face config alone: a config.json file, a
    folder holding one, or its dict. Nothing is read but the config and nothing is allocated:
    the parameters are ``jax.ShapeDtypeStruct``s, for a Trainer that plans and compiles a run
    (``redcoast plan``) before any weight exists."""
    if isinstance(config, dict):
        config_dict = config
    elif os.path.isfile(config):
        with open(config) as f:
            config_dict = json.load(f)
    else:
        config_dict = hf.read_config(config)
    family = family_of(config_dict.get("model_type"))
    parsed = parse_config(family, config_dict, None, config_overrides)
    model = Model(module_class(family, config_dict, architecture), parsed, param_dtype=param_dtype)
    return model, model.abstract_params()


def from_reader(config_dict, reader, deployer=None, *, shardings=None, param_dtype=jnp.float32,
                architecture=None, fsdp=False, config_overrides=None, rng=None, init_seed=None):
    """``(model, params)`` from a config.json dict and a tensor ``reader`` (``.shape(name)``,
    ``.read(name, index)`` over Hugging Face tensor names), placed as :func:`from_pretrained`
    does; GGUF files come through here too. With ``init_seed`` (an int) no tensor is read: every
    parameter is initialised from that seed, placed the same way."""
    family = family_of(config_dict.get("model_type"))
    config = parse_config(family, config_dict, reader, config_overrides)
    module_cls = module_class(family, config_dict, architecture)
    model = Model(module_cls, config, param_dtype=param_dtype)
    abstract = model.abstract_params()
    if shardings is None and deployer is not None:
        plan = deployer.get_sharding_plan(abstract, fsdp=fsdp, traced_fn=model.apply,
                                          example_args=family.example_inputs(config, module_cls))
        shardings = plan.param_shardings()
    if shardings is None:
        device = jax.local_devices()[0]
        shardings = jax.tree_util.tree_map(
            lambda _: jax.sharding.SingleDeviceSharding(device), abstract)
    if init_seed is not None:
        return model, model.init(init_seed, out_shardings=shardings)
    params = load_or_init(model, family, reader, abstract, shardings, deployer, rng)
    return model, params


def _is_source(x):
    return hf.is_source(x)


def _path_str(path):
    return ".".join(key_to_str(k) for k in path)


def _stored_names(reader):
    """Every tensor name the reader holds, or None when it cannot list them."""
    if hasattr(reader, "names"):
        return list(reader.names())
    if hasattr(reader, "tensors"):
        return list(reader.tensors)
    try:
        return list(reader)
    except TypeError:
        return None


def _report(deployer, text):
    if deployer is not None:
        deployer.log_warning(text)
    else:
        logging.getLogger(__name__).warning(text)


def load_or_init(model, family, reader, abstract, shardings, deployer=None, rng=None):
    """The params: every parameter the reader holds is read (each device its slice); task-head
    parameters it lacks are initialised fresh; anything else missing or misshapen is an error."""
    sources = family.hf_sources(model.config, model.module_cls)
    flat_sources, treedef = jax.tree_util.tree_flatten_with_path(sources, is_leaf=_is_source)
    flat_abstract = treedef.flatten_up_to(abstract)
    flat_shardings = treedef.flatten_up_to(shardings)
    heads = tuple(getattr(family, "TASK_HEADS", {}).get(model.module_cls, ()))
    # each parameter's stored tensors: one, or one per layer for layers stacked for a scan
    leaf_parts = [hf.parts(src, a.shape) for (_, src), a in zip(flat_sources, flat_abstract)]
    stored = [[hf.stored_name(reader, part) for part, _ in ps] for ps in leaf_parts]
    names = _stored_names(reader)
    # a listed name is checked without reading it (``in`` on a Mapping such as GGUFTensors would
    # dequantise the tensor)
    listed = set(names) if names is not None else reader
    present = [all(name in listed for name in leaf) for leaf in stored]
    missing = [(_path_str(path), name, a.shape)
               for (path, _), a, leaf, ok in zip(flat_sources, flat_abstract, stored, present)
               if not ok for name in leaf if name not in listed]
    body_missing = [m for m in missing if m[0].split(".")[0] not in heads]
    arch = model.module_cls.__name__
    if body_missing:
        listed = ", ".join(name for _, name, _ in body_missing[:8])
        more = f" and {len(body_missing) - 8} more" if len(body_missing) > 8 else ""
        raise ConfigError(
            f"the checkpoint lacks {len(body_missing)} of the {sum(map(len, stored))} tensors of "
            f"{arch}'s body: {listed}{more}. Only a task head "
            f"({', '.join(heads) or 'none for ' + arch}) may be missing; check that the folder "
            "holds this model family's weights, and that config.json matches them.")
    wrong = []
    for ps, leaf, ok in zip(leaf_parts, stored, present):
        for (part, part_shape), name in zip(ps, leaf):
            expected = hf.stored_shape(part, part_shape)
            if ok and tuple(reader.shape(name)) != expected:
                wrong.append(f"{name} {tuple(reader.shape(name))} (expected {expected})")
    if wrong:
        raise ConfigError(f"{len(wrong)} stored tensors have other shapes than {arch} with this "
                          f"config needs: {'; '.join(wrong)}. Fix config.json or config_overrides "
                          "(e.g. num_labels) to match the checkpoint.")
    fresh = {}
    if missing:
        if rng is None:
            rng = deployer.gen_rng() if deployer is not None else jax.random.key(0)
        fresh = _fresh_params(model, [p for (p, _), ok in zip(flat_sources, present) if not ok],
                              [s for s, ok in zip(flat_shardings, present) if not ok], rng)
        _report(deployer, f"{arch}: {len(missing)} parameters of its task head are not in the "
                "checkpoint and are freshly initialised (train them before use): "
                + ", ".join(f"{p} {tuple(shape)}" for p, _, shape in missing))
    if names is not None:
        used = {name for leaf, ok in zip(stored, present) if ok for name in leaf}
        ok_unused = getattr(family, "UNUSED_OK", ())
        unused = [n for n in names if n not in used and not any(re.search(r, n) for r in ok_unused)]
        if unused:
            _report(deployer, f"{arch} does not use {len(unused)} stored tensors (left unread): "
                    + ", ".join(sorted(unused)))
    leaves = []
    for (path, src), a, s, ok in zip(flat_sources, flat_abstract, flat_shardings, present):
        leaves.append(hf.load_array(reader, src, a.shape, s, np.dtype(a.dtype)) if ok
                      else fresh[_path_str(path)])
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _fresh_params(model, paths, shardings, rng):
    """{dotted path: array} of ``paths`` from the module's own initialisers with ``rng``; the
    rest of the module is built only abstractly inside jit, so XLA drops it unused."""
    from flax import nnx

    from .base import INIT_COMPILER_OPTIONS, _str_keys

    def make():
        _, state, _ = nnx.split(model.module_cls(model.config, rngs=nnx.Rngs(rng),
                                                 param_dtype=model.param_dtype), nnx.Param, ...)
        full = _str_keys(nnx.to_pure_dict(state))
        out = []
        for path in paths:
            leaf = full
            for key in path:
                leaf = leaf[str(getattr(key, "key", key))]
            out.append(leaf)
        return out

    arrays = jax.jit(make, out_shardings=list(shardings), compiler_options=INIT_COMPILER_OPTIONS)()
    return {_path_str(p): a for p, a in zip(paths, arrays)}


def hf_tensors(model, params):
    """``{stored name: Deferred}`` in the Hugging Face layout (transposes and reshapes undone
    on the host when each tensor is fetched, so nothing is copied on the devices; layers stacked
    for a scan written one tensor per layer)."""
    family = family_of(model.config.to_hf()["model_type"])
    sources = family.hf_sources(model.config, model.module_cls)
    out = {}
    for src, value in zip(jax.tree_util.tree_leaves(sources, is_leaf=hf.is_source),
                          jax.tree_util.tree_leaves(params)):
        stacked = isinstance(src, hf.Stacked)
        for i, (part, part_shape) in enumerate(hf.parts(src, np.shape(value))):
            shape = hf.stored_shape(part, part_shape)

            def fetch(value=value, part=part, shape=shape, row=i if stacked else None):
                array = host_array(value) if row is None else host_row(value, row)
                return (array.T if part.transpose else array).reshape(shape)

            out[part.name] = Deferred(shape, np.dtype(value.dtype), fetch)
    return out


def save_pretrained(model, params, folder, max_shard_bytes=None, *, tokenizer=None,
                    generation_config=None):
    """Write a folder that transformers (PyTorch) loads with ``from_pretrained(folder)``.

    Besides config.json (with the parameters' ``dtype``) and the weights: generation_config.json
    (the config's BOS / EOS / pad ids, the source folder's generation_config.json, then
    ``generation_config``, a dict, over them), which ``GenerationConfig.from_pretrained`` and
    ``generate`` read; and with ``tokenizer`` (a transformers tokenizer, or the
    ``tokenizers.Tokenizer`` that ``from_gguf`` returns) its files with the model's chat
    template, which ``AutoTokenizer.from_pretrained`` loads. Call it on every process; process
    0 writes. Tied weights are stored once."""
    tensors = hf_tensors(model, params)
    config = model.config.to_hf()
    dtype = folder_extras.params_dtype(params)
    if dtype is not None:
        config["dtype"] = dtype
        config.pop("torch_dtype", None)  # transformers 5's name is dtype
    family = family_of(config["model_type"])
    named = list(config.get("architectures") or [])
    if not (named and family.MODULES.get(named[0]) is model.module_cls):
        # the class actually saved (e.g. a classifier folder loaded as BertModel)
        config["architectures"] = [n for n, cls in family.MODULES.items() if cls is model.module_cls][:1]
    hf.save_folder(folder, config, tensors, max_shard_bytes=max_shard_bytes)
    if jax.process_index() != 0:
        return
    defaults = folder_extras.generation_config(model, config, generation_config)
    if defaults:
        hf.write_json(os.path.join(folder, "generation_config.json"), defaults)
    if tokenizer is not None:
        folder_extras.write_tokenizer(folder, tokenizer, model, config)
