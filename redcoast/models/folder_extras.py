"""What an exported Hugging Face folder holds besides config.json and the weights, so that
transformers' ``AutoTokenizer`` and ``GenerationConfig`` load it as they load the source:
``generation_config.json`` (the model's generation defaults) and the tokenizer's files."""

import os

import jax
import numpy as np

from ..errors import ConfigError
from ..store.folder_files import file_in_folder
from .hf import write_json

GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def params_dtype(params):
    """The name transformers reads in config.json's ``dtype`` (``"float32"``, ``"bfloat16"``):
    that of the floating-point parameters, the most common one where they mix."""
    counts = {}
    for leaf in jax.tree_util.tree_leaves(params):
        dtype = np.dtype(leaf.dtype)
        if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16":
            counts[dtype.name] = counts.get(dtype.name, 0) + int(np.prod(leaf.shape))
    return max(counts, key=counts.get) if counts else None


def generation_config(model, config, overrides=None):
    """generation_config.json's content: the config's special token ids, the source folder's
    generation_config.json over them, ``overrides`` over both; None where nothing is known."""
    out = {k: config[k] for k in GENERATION_KEYS if config.get(k) is not None}
    out.update(getattr(model, "generation_config", None) or {})
    out.update(overrides or {})
    return out or None


def write_tokenizer(folder, tokenizer, model, config):
    """The files of ``tokenizer`` that ``AutoTokenizer.from_pretrained(folder)`` loads: a
    transformers tokenizer saves itself; a ``tokenizers.Tokenizer`` (what ``from_gguf`` returns)
    is written as ``tokenizer.json`` with a ``tokenizer_config.json`` naming its special tokens
    and the model's chat template."""
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(folder)
        return
    if not (hasattr(tokenizer, "save") and hasattr(tokenizer, "id_to_token")):
        raise ConfigError(f"save_pretrained(tokenizer=...) takes a transformers tokenizer or a "
                          f"tokenizers.Tokenizer, not {type(tokenizer).__name__}.")
    template = getattr(model, "chat_template", None)
    tokens = dict(template.special_tokens) if template is not None else {}
    for name in ("bos", "eos", "pad"):  # the config's ids, where the template did not say
        index = config.get(f"{name}_token_id")
        if isinstance(index, (list, tuple)):
            index = index[0] if index else None
        if f"{name}_token" not in tokens and index is not None:
            text = tokenizer.id_to_token(int(index))
            if text is not None:
                tokens[f"{name}_token"] = text
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                        "clean_up_tokenization_spaces": False, **tokens}
    if config.get("max_position_embeddings"):
        tokenizer_config["model_max_length"] = int(config["max_position_embeddings"])
    if template is not None:
        tokenizer_config["chat_template"] = template.source
    # tokenizers writes through a link that is there: never into a file outside the folder
    tokenizer.save(file_in_folder(folder, "tokenizer.json", "the tokenizer written"))
    write_json(os.path.join(folder, "tokenizer_config.json"), tokenizer_config)
