"""The Llama family of decoders: Llama 2/3, Mistral, Qwen2, SmolLM2 (one architecture, a few
switches) in Flax NNX, with Hugging Face config and weight names.

A pre-norm transformer: token embedding, then per layer ``x + attn(norm(x))`` and
``x + mlp(norm(x))`` with rotary positions, grouped-query attention and a SwiGLU MLP, a final
RMSNorm and an LM head (its own matrix, or the embedding when tied). The switches:
``attention_bias`` (Qwen2: biases on q/k/v; ``attention_out_bias`` for o), ``mlp_bias``,
``sliding_window`` (Mistral; Qwen2 per ``layer_types``), ``rope_scaling`` (linear, dynamic,
llama3, yarn).

Family protocol for :mod:`redcoast.models.pretrained`: ``Config``, ``MODULES``,
``DEFAULT_MODULE``, ``hf_sources``, ``example_inputs``. Weights from elsewhere than a
safetensors folder (GGUF) load through ``pretrained.from_reader`` with any reader object that
has ``shape(name)`` and ``read(name, index)`` over Hugging Face names and layouts;
:func:`params_from_tensors` does it for an in-memory ``{name: array}`` dict.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import FrozenDict

from ..errors import ConfigError
from . import hf
from . import stacked
from .blocks import packed_rows
from .layers import (RMSNorm, apply_rotary, attend, attention_mask, rope_type, rotary_cos_sin,
                     write_cache)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}

# What transformers assumes for a key missing from config.json, where it differs per family.
_HF_DEFAULTS = {
    "llama": dict(vocab_size=32000, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                  sliding_window=None),
    "mistral": dict(vocab_size=32000, max_position_embeddings=131072, bos_token_id=1,
                    eos_token_id=2, num_key_value_heads=8, sliding_window=4096),
    "qwen2": dict(vocab_size=151936, max_position_embeddings=32768, bos_token_id=None,
                  eos_token_id=None, num_key_value_heads=32, sliding_window=4096),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder (field names as in Hugging Face configs).

    ``rope_scaling``: None, or a mapping with ``rope_type`` ("linear", "dynamic", "llama3",
    "yarn") and that type's fields, as in transformers' ``rope_parameters`` minus
    ``rope_theta``. ``layer_types``: per layer "full_attention" or "sliding_attention" (Qwen2);
    None applies ``sliding_window`` (if set) to every layer (Mistral). ``dtype``: the compute
    dtype (parameters keep theirs); ``remat``: recompute each layer in the backward pass;
    ``scan_layers``: the layers' parameters stacked (``layers/.../kernel`` of shape ``[layers,
    ...]``) and run by a scan, so that the step compiles one layer whatever their number
    (:mod:`redcoast.models.stacked`; Hugging Face folders keep one tensor per layer).
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: as many as query heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k, v
    attention_out_bias: bool | None = None  # bias on o; None: as attention_bias
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple | None = None
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    bos_token_id: Any = 1
    eos_token_id: Any = 2
    pad_token_id: Any = None
    model_type: str = "llama"
    dtype: Any = jnp.float32
    remat: bool = False
    scan_layers: bool = False
    attention_implementation: str | None = None  # None: per call (models/attention.py)

    def __post_init__(self):
        # Normalise to hashable values: the config is a static part of the module.
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        if self.attention_out_bias is None:
            set_("attention_out_bias", self.attention_bias)
        if self.rope_scaling is not None:
            set_("rope_scaling", FrozenDict(self.rope_scaling))
        if self.layer_types is not None:
            set_("layer_types", tuple(self.layer_types))
        if isinstance(self.eos_token_id, list):
            set_("eos_token_id", tuple(self.eos_token_id))
        self._check()

    def _check(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}; grouped-query "
                              "attention needs whole groups. Fix the config.")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r}: the Llama family here uses SwiGLU "
                              "(hidden_act='silu') only.")
        if self.model_type not in ARCHITECTURES:
            raise ConfigError(f"model_type={self.model_type!r}; LlamaConfig reads "
                              f"{sorted(ARCHITECTURES)}.")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                              f"{self.num_hidden_layers} layers; give one per layer.")
        rope_type(self.rope_scaling)  # a clear error now for an unknown scaling
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        if self.scan_layers and len(windows) > 1:
            raise ConfigError(f"scan_layers=True runs one layer program for all layers, but these "
                              f"layers differ in their attention windows ({sorted(windows, key=str)}"
                              "; layer_types mixes sliding and full attention). Fix: "
                              "scan_layers=False for this model.")

    def layer_window(self, i):
        """The sliding window of layer ``i`` (None: full causal attention)."""
        if self.layer_types is not None and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, d):
        """A config from a Hugging Face config.json dict (model_type llama, mistral or qwen2; as
        transformers v5 writes it, or v4's ``rope_theta``/``rope_scaling``)."""
        model_type = d.get("model_type", "llama")
        if model_type not in _HF_DEFAULTS:
            raise ConfigError(f"model_type {model_type!r} is not a Llama-family model; "
                              f"redcoast.models.llama reads {sorted(_HF_DEFAULTS)}.")
        defaults = _HF_DEFAULTS[model_type]
        get = lambda key, default=None: d.get(key, defaults.get(key, default))  # noqa: E731
        theta, scaling = _rope_from_hf(d)
        if scaling is not None and scaling["rope_type"] in ("llama3", "yarn"):
            scaling.setdefault("original_max_position_embeddings", get("max_position_embeddings"))
        sliding_window, layer_types = get("sliding_window"), None
        if model_type == "llama":
            sliding_window = None
        if model_type == "qwen2":
            if not d.get("use_sliding_window", False):
                sliding_window = None
            layer_types = d.get("layer_types") or [
                "sliding_attention" if sliding_window is not None
                and i >= d.get("max_window_layers", 28) else "full_attention"
                for i in range(d["num_hidden_layers"])]
        qkv_bias = True if model_type == "qwen2" else d.get("attention_bias", False)
        out_bias = False if model_type == "qwen2" else d.get("attention_bias", False)
        return cls(
            vocab_size=get("vocab_size"), hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=get("num_key_value_heads"), head_dim=d.get("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=get("max_position_embeddings"),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=qkv_bias, attention_out_bias=out_bias,
            mlp_bias=d.get("mlp_bias", False) if model_type == "llama" else False,
            sliding_window=sliding_window, layer_types=layer_types,
            hidden_act=d.get("hidden_act", "silu"),
            initializer_range=d.get("initializer_range", 0.02),
            bos_token_id=get("bos_token_id"), eos_token_id=get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"), model_type=model_type)

    def to_hf(self):
        """The config.json dict transformers (v5) reads back into this config."""
        mt = self.model_type
        expressible = {
            "attention_out_bias": self.attention_out_bias == (self.attention_bias and mt != "qwen2"),
            "attention_bias": mt == "llama" or self.attention_bias == (mt == "qwen2"),
            "mlp_bias": mt == "llama" or not self.mlp_bias,
            "sliding_window": mt != "llama" or self.sliding_window is None,
            "layer_types": mt == "qwen2" or self.layer_types is None,
        }
        for field, ok in expressible.items():
            if not ok:
                raise ConfigError(f"{field}={getattr(self, field)!r} cannot be written as a "
                                  f"model_type={mt!r} config.json. Fix: choose the model_type "
                                  "whose architecture has it (llama: biases; mistral: sliding "
                                  "window; qwen2: q/k/v biases and per-layer windows).")
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        rope.update(dict(self.rope_scaling or {}))
        out = dict(
            model_type=mt, architectures=[ARCHITECTURES[mt]], vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_parameters=rope,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, hidden_act=self.hidden_act,
            initializer_range=self.initializer_range, bos_token_id=self.bos_token_id,
            eos_token_id=(list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                          else self.eos_token_id),
            pad_token_id=self.pad_token_id)
        if mt == "llama":
            out.update(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
        if mt == "mistral":
            out.update(sliding_window=self.sliding_window)
        if mt == "qwen2":
            types = list(self.layer_types or ["sliding_attention" if self.sliding_window
                                              else "full_attention"] * self.num_hidden_layers)
            sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
            use = self.sliding_window is not None and bool(sliding)
            out.update(use_sliding_window=use, sliding_window=self.sliding_window,
                       max_window_layers=sliding[0] if use else self.num_hidden_layers,
                       layer_types=types if use else ["full_attention"] * self.num_hidden_layers)
        return out


def _rope_from_hf(d):
    """``(theta, scaling dict or None)`` from v5 ``rope_parameters`` or v4 ``rope_theta`` +
    ``rope_scaling``."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type", params.pop("type", "default"))
    partial = params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor={partial}: the Llama family rotates whole heads; "
                          "this checkpoint is not a Llama-family model.")
    if kind == "default":
        return theta, None
    return theta, {"rope_type": kind, **params}


Config = LlamaConfig


# ---------------------------------------------------------------------------------------------
# Modules

def _linear(n_in, n_out, bias, config, rngs, param_dtype):
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=config.dtype, param_dtype=param_dtype,
                      kernel_init=nnx.initializers.normal(config.initializer_range), rngs=rngs)


class LlamaAttention(nnx.Module):
    """Grouped-query self-attention with rotary positions and an optional sliding window."""

    def __init__(self, config, window, *, rngs, param_dtype=jnp.float32):
        c = config
        self.config = config
        self.window = window
        qkv = c.attention_bias
        self.q_proj = _linear(c.hidden_size, c.num_attention_heads * c.head_dim, qkv, c, rngs,
                              param_dtype)
        self.k_proj = _linear(c.hidden_size, c.num_key_value_heads * c.head_dim, qkv, c, rngs,
                              param_dtype)
        self.v_proj = _linear(c.hidden_size, c.num_key_value_heads * c.head_dim, qkv, c, rngs,
                              param_dtype)
        self.o_proj = _linear(c.num_attention_heads * c.head_dim, c.hidden_size,
                              c.attention_out_bias, c, rngs, param_dtype)

    def __call__(self, x, cos, sin, key_valid, cache=None, cache_index=None, segment_ids=None):
        c = self.config
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None and key_valid is None:  # causal, unpadded: the kernel masks itself
            y = attend(q, k, v, None, scale=c.head_dim ** -0.5, causal=True, window=self.window,
                       implementation=c.attention_implementation)
            return self.o_proj(y.reshape(b, t, c.num_attention_heads * c.head_dim)), cache
        query_slots = jnp.arange(t)
        if cache is not None:
            cache = {"k": write_cache(cache["k"], k, cache_index),
                     "v": write_cache(cache["v"], v, cache_index)}
            k, v = cache["k"], cache["v"]
            query_slots = query_slots + cache_index
        mask = attention_mask(query_slots, jnp.arange(k.shape[1]), key_valid, self.window,
                              segment_ids)
        y = attend(q, k, v, mask, scale=c.head_dim ** -0.5,
                   implementation=c.attention_implementation)
        return self.o_proj(y.reshape(b, t, c.num_attention_heads * c.head_dim)), cache


class LlamaMLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.gate_proj = _linear(c.hidden_size, c.intermediate_size, c.mlp_bias, c, rngs,
                                 param_dtype)
        self.up_proj = _linear(c.hidden_size, c.intermediate_size, c.mlp_bias, c, rngs,
                               param_dtype)
        self.down_proj = _linear(c.intermediate_size, c.hidden_size, c.mlp_bias, c, rngs,
                                 param_dtype)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config, index, *, rngs, param_dtype=jnp.float32):
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=c.dtype,
                                       param_dtype=param_dtype)
        self.self_attn = LlamaAttention(c, c.layer_window(index), rngs=rngs,
                                        param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=c.dtype,
                                                param_dtype=param_dtype)
        self.mlp = LlamaMLP(c, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x, cos, sin, key_valid, cache=None, cache_index=None, segment_ids=None):
        h, cache = self.self_attn(self.input_layernorm(x), cos, sin, key_valid, cache, cache_index,
                                  segment_ids)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class LlamaForCausalLM(nnx.Module):
    """Token ids -> next-token logits (float32), with an optional KV cache (see
    :meth:`__call__` and :meth:`init_cache`)."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.config = config
        self.embed_tokens = nnx.Embed(
            c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(c.initializer_range), rngs=rngs)
        if c.scan_layers:  # every layer has the same window (checked by the config)
            self.layers = stacked.stacked_layers(
                lambda r: LlamaDecoderLayer(c, 0, rngs=r, param_dtype=param_dtype),
                c.num_hidden_layers, rngs)
        else:
            self.layers = nnx.List([LlamaDecoderLayer(c, i, rngs=rngs, param_dtype=param_dtype)
                                    for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=c.dtype,
                            param_dtype=param_dtype)
        if not c.tie_word_embeddings:
            self.lm_head = _linear(c.hidden_size, c.vocab_size, False, c, rngs, param_dtype)

    def init_cache(self, batch_size, max_length, dtype=jnp.float32):
        """An empty cache: ``{"layers": {"0": {"k": [B, S, KVH, D], "v": ...}, ...}}``."""
        c = self.config
        shape = (batch_size, max_length, c.num_key_value_heads, c.head_dim)
        return {"layers": {str(i): {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                           for i in range(c.num_hidden_layers)}}

    def __call__(self, input_ids, attention_mask=None, positions=None, cache=None,
                 cache_index=None, segment_ids=None):
        """Logits ``[B, T, vocab]`` float32; with ``cache``, ``(logits, new_cache)``.

        Without a cache: ``attention_mask [B, T]`` (1 real, 0 padding) is optional; positions
        default to the count of real tokens before each one (left padding works). With a cache:
        ``input_ids[:, 0]`` goes to slot ``cache_index`` (int32 scalar, the same for all rows),
        ``attention_mask [B, S_max]`` marks the slots that hold (or now receive) real tokens,
        and ``positions [B, T]`` are required. ``segment_ids [B, T]`` (training on sequences
        packed in a row, :func:`redcoast.text.packing.pack_sequences`; no cache): tokens attend
        within their own segment only, 0 marks padding, and positions default to each
        segment's own count, so each sequence computes as if it stood alone.
        """
        c = self.config
        b, t = input_ids.shape
        if segment_ids is not None:
            attention_mask, positions = packed_rows(segment_ids, attention_mask, positions, cache)
        if cache is not None:
            if positions is None or cache_index is None:
                raise ConfigError("decoding with a cache needs positions [B, T] and cache_index; "
                                  "pass both (see LlamaForCausalLM.__call__).")
            if attention_mask is None:
                max_len = next(iter(cache["layers"].values()))["k"].shape[1]
                attention_mask = jnp.ones((b, max_len), jnp.int32)
        elif attention_mask is None:
            # no padding: causal attention that the kernel masks itself (attention_mask stays None)
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
        cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta, c.rope_scaling,
                                  c.max_position_embeddings)
        x = self.embed_tokens(input_ids)
        x, new_cache = stacked.run_layers(
            self.layers, c.num_hidden_layers, x, cache,
            lambda layer, h, layer_cache: layer(h, cos, sin, attention_mask, layer_cache,
                                                cache_index, segment_ids),
            scanned=c.scan_layers, remat=c.remat)
        x = self.norm(x)
        logits = self.embed_tokens.attend(x) if c.tie_word_embeddings else self.lm_head(x)
        logits = logits.astype(jnp.float32)
        return logits if cache is None else (logits, new_cache)


MODULES = {name: LlamaForCausalLM for name in ARCHITECTURES.values()}
DEFAULT_MODULE = LlamaForCausalLM


# ---------------------------------------------------------------------------------------------
# Hugging Face weights

def hf_sources(config, module_cls=LlamaForCausalLM):
    """Which Hugging Face tensor fills each parameter (mirrors ``abstract_params()``)."""
    linear = lambda name, bias: dict(  # noqa: E731
        kernel=hf.Source(f"{name}.weight", transpose=True),
        **({"bias": hf.Source(f"{name}.bias")} if bias else {}))
    c = config
    layers = {}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        layers[str(i)] = {
            "input_layernorm": {"scale": hf.Source(f"{p}.input_layernorm.weight")},
            "post_attention_layernorm": {
                "scale": hf.Source(f"{p}.post_attention_layernorm.weight")},
            "self_attn": {
                "q_proj": linear(f"{p}.self_attn.q_proj", c.attention_bias),
                "k_proj": linear(f"{p}.self_attn.k_proj", c.attention_bias),
                "v_proj": linear(f"{p}.self_attn.v_proj", c.attention_bias),
                "o_proj": linear(f"{p}.self_attn.o_proj", c.attention_out_bias)},
            "mlp": {name: linear(f"{p}.mlp.{name}", c.mlp_bias)
                    for name in ("gate_proj", "up_proj", "down_proj")},
        }
    if c.scan_layers:
        layers = hf.stack_sources([layers[str(i)] for i in range(c.num_hidden_layers)])
    out = {"embed_tokens": {"embedding": hf.Source("model.embed_tokens.weight")},
           "layers": layers, "norm": {"scale": hf.Source("model.norm.weight")}}
    if not c.tie_word_embeddings:
        out["lm_head"] = linear("lm_head", False)
    return out


def example_inputs(config, module_cls=LlamaForCausalLM):
    """Abstract ``input_ids`` for tracing the forward pass (the sharding plan)."""
    return (jax.ShapeDtypeStruct((1, 8), jnp.int32),)

