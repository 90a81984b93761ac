"""``from_pretrained`` / ``save_pretrained`` for every model family in redcoast.models.

A family is a module (``redcoast.models.llama``, ...) that provides:

- ``Config``: a dataclass with ``Config.from_hf(dict)`` and ``config.to_hf() -> dict`` (the
  Hugging Face config.json, ``model_type`` and ``architectures`` included);
- ``MODULES``: {Hugging Face architecture name: NNX module class}, and ``DEFAULT_MODULE``;
- ``hf_sources(config, module_cls)``: a pytree of :class:`redcoast.models.hf.Source` mirroring
  ``Model(module_cls, config).abstract_params()``: which stored tensor fills each parameter;
- ``example_inputs(config, module_cls)``: abstract positional inputs of the module's
  ``__call__`` (``jax.ShapeDtypeStruct``), traced to derive the sharding plan.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError
from ..tensor_files import Deferred, host_array
from . import hf
from .base import Model

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
                    architecture=None, fsdp=False, config_overrides=None):
    """``(model, params)`` from a local Hugging Face folder (config.json + safetensors).

    With a ``deployer``, each parameter is placed straight into its shards on the deployer's
    mesh by the plan traced from the model's forward pass (the plan the Trainer would choose;
    ``fsdp=True`` also splits over 'dp'); each device reads only its slice of each tensor.
    Without one, everything goes to the first local device. ``config_overrides`` replaces
    fields of the parsed config (e.g. ``{"remat": True, "dtype": jnp.bfloat16}``).
    """
    return from_reader(hf.read_config(folder), hf.SafetensorsFolder(folder), deployer,
                       shardings=shardings, param_dtype=param_dtype, architecture=architecture,
                       fsdp=fsdp, config_overrides=config_overrides)


def from_reader(config_dict, reader, deployer=None, *, shardings=None, param_dtype=jnp.float32,
                architecture=None, fsdp=False, config_overrides=None):
    """``(model, params)`` from a config.json dict and a tensor ``reader`` (``.shape(name)``,
    ``.read(name, index)`` over Hugging Face tensor names), placed as :func:`from_pretrained`
    does; GGUF files come through here too."""
    family = family_of(config_dict.get("model_type"))
    config = family.Config.from_hf(config_dict)
    if hasattr(family, "config_for_tensors"):  # when config.json alone does not say (T5's lm_head)
        config = family.config_for_tensors(config, reader)
    if config_overrides:
        import dataclasses

        config = dataclasses.replace(config, **config_overrides)
    module_cls = module_class(family, config_dict, architecture)
    model = Model(module_cls, config, param_dtype=param_dtype)
    abstract = model.abstract_params()
    if shardings is None and deployer is not None:
        plan = deployer.get_sharding_plan(abstract, fsdp=fsdp, traced_fn=model.apply,
                                          example_args=family.example_inputs(config, module_cls))
        shardings = plan.param_shardings()
    params = hf.load_params(reader, family.hf_sources(config, module_cls), abstract, shardings)
    return model, params


def hf_tensors(model, params):
    """``{stored name: Deferred}`` in the Hugging Face layout (transposes and reshapes undone
    on the host when each tensor is fetched, so nothing is copied on the devices)."""
    family = family_of(model.config.to_hf()["model_type"])
    sources = family.hf_sources(model.config, model.module_cls)
    is_source = lambda x: isinstance(x, hf.Source)  # noqa: E731
    out = {}
    for src, value in zip(jax.tree_util.tree_leaves(sources, is_leaf=is_source),
                          jax.tree_util.tree_leaves(params)):
        shape = tuple(np.shape(value))[::-1] if src.transpose else tuple(np.shape(value))
        shape = shape if src.shape is None else tuple(src.shape)

        def fetch(value=value, src=src, shape=shape):
            array = host_array(value)
            return (array.T if src.transpose else array).reshape(shape)

        out[src.name] = Deferred(shape, np.dtype(value.dtype), fetch)
    return out


def save_pretrained(model, params, folder, max_shard_bytes=None):
    """Write a folder that transformers (PyTorch) loads with ``from_pretrained(folder)``.

    Call it on every process; process 0 writes. Tied weights are stored once."""
    tensors = hf_tensors(model, params)
    config = model.config.to_hf()
    family = family_of(config["model_type"])
    named = list(config.get("architectures") or [])
    if not (named and family.MODULES.get(named[0]) is model.module_cls):
        # the class actually saved (e.g. a classifier folder loaded as BertModel)
        config["architectures"] = [n for n, cls in family.MODULES.items() if cls is model.module_cls][:1]
    hf.save_folder(folder, config, tensors, max_shard_bytes=max_shard_bytes)
