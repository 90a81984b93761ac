"""BART (facebook/bart-base, bart-large, bart-large-cnn, ...) as a Flax NNX encoder-decoder with
Hugging Face weights; generation (greedy, sampling, beam search) through
:mod:`redcoast.models.generate_seq2seq`, like T5.

Post-LN encoder and decoder layers with biases everywhere, learned positions with two unused
rows in front (position p reads row p + 2; positions count slots, padding included, as in
transformers), a LayerNorm on the embeddings, token embeddings multiplied by sqrt(d_model) when
``scale_embedding``, and an LM head tied to the shared embedding plus ``final_logits_bias``
(a buffer in PyTorch, kept here as a parameter so that it is read and written with the rest).

Decoding with a cache stores the decoder's self-attention keys and values; the cross-attention
keys and values depend only on the encoder output and are computed once (:meth:`cross_kv`).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import ConfigError
from . import hf, stacked
from .activations import activation
from .blocks import (LearnedPositions, check_length, dense, empty_kv_cache, key_mask, layer_norm,
                     merge_heads, split_heads)
from .layers import attend, write_cache
from .layers import attention_mask as causal_mask

POSITION_OFFSET = 2
_HOW_IT_RUNS = ("dtype", "remat", "scan_layers")  # Config fields not in config.json


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 50265
    max_position_embeddings: int = 1024
    d_model: int = 1024
    encoder_layers: int = 12
    encoder_ffn_dim: int = 4096
    encoder_attention_heads: int = 16
    decoder_layers: int = 12
    decoder_ffn_dim: int = 4096
    decoder_attention_heads: int = 16
    activation_function: str = "gelu"
    init_std: float = 0.02
    scale_embedding: bool = False
    pad_token_id: Any = 1
    bos_token_id: Any = 0
    eos_token_id: Any = 2
    decoder_start_token_id: Any = 2
    forced_bos_token_id: Any = None  # kept for the config.json round trip; generation ignores it
    forced_eos_token_id: Any = 2  # likewise
    dtype: Any = jnp.float32
    remat: bool = False
    scan_layers: bool = False  # each stack's layers stacked and run by a scan (stacked.py)

    def __post_init__(self):
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        activation(self.activation_function, "activation_function")
        for side in ("encoder", "decoder"):
            heads = getattr(self, f"{side}_attention_heads")
            if self.d_model % heads:
                raise ConfigError(f"d_model {self.d_model} is not a multiple of "
                                  f"{side}_attention_heads {heads}.")

    @classmethod
    def from_hf(cls, d):
        if d.get("tie_word_embeddings", True) is False:
            raise ConfigError("tie_word_embeddings=false: redcoast's BART ties its LM head to the "
                              "shared embedding, as every released BART does.")
        if d.get("normalize_before") or d.get("add_final_layer_norm"):
            raise ConfigError("normalize_before / add_final_layer_norm (mBART's pre-LN layout) are "
                              "not supported; redcoast's BART is post-LN.")
        names = {f.name for f in dataclasses.fields(cls)} - set(_HOW_IT_RUNS)
        return cls(**{k: d[k] for k in names if k in d})

    def to_hf(self):
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in _HOW_IT_RUNS}
        if isinstance(d["eos_token_id"], tuple):
            d["eos_token_id"] = list(d["eos_token_id"])
        return {**d, "model_type": "bart", "architectures": ["BartForConditionalGeneration"],
                "is_encoder_decoder": True, "tie_word_embeddings": True, "dropout": 0.0,
                "attention_dropout": 0.0, "activation_dropout": 0.0}


class BartAttention(nnx.Module):
    """Multi-head attention with biased projections; keys/values from the same input
    (self-attention) or from the encoder output (cross-attention, :meth:`kv`)."""

    def __init__(self, config, heads, *, rngs, param_dtype=jnp.float32):
        c = config
        self.heads = heads
        self.scale = (c.d_model // heads) ** -0.5
        kw = dict(dtype=c.dtype, param_dtype=param_dtype, rngs=rngs, std=c.init_std)
        self.q_proj = dense(c.d_model, c.d_model, **kw)
        self.k_proj = dense(c.d_model, c.d_model, **kw)
        self.v_proj = dense(c.d_model, c.d_model, **kw)
        self.out_proj = dense(c.d_model, c.d_model, **kw)

    def kv(self, x):
        return split_heads(self.k_proj(x), self.heads), split_heads(self.v_proj(x), self.heads)

    def __call__(self, x, k, v, mask):
        q = split_heads(self.q_proj(x), self.heads)
        return self.out_proj(merge_heads(attend(q, k, v, mask, scale=self.scale)))


class BartLayer(nnx.Module):
    """``ln(x + self_attn(x))``, in the decoder ``ln(x + cross_attn(x))``, then
    ``ln(x + fc2(act(fc1(x))))``."""

    def __init__(self, config, *, decoder, rngs, param_dtype=jnp.float32):
        c = config
        side = "decoder" if decoder else "encoder"
        heads, ffn = getattr(c, f"{side}_attention_heads"), getattr(c, f"{side}_ffn_dim")
        norm = dict(dtype=c.dtype, param_dtype=param_dtype, rngs=rngs)
        kw = dict(dtype=c.dtype, param_dtype=param_dtype, rngs=rngs, std=c.init_std)
        self.act = activation(c.activation_function)
        self.self_attn = BartAttention(c, heads, rngs=rngs, param_dtype=param_dtype)
        self.self_attn_layer_norm = layer_norm(c.d_model, **norm)
        if decoder:
            self.encoder_attn = BartAttention(c, heads, rngs=rngs, param_dtype=param_dtype)
            self.encoder_attn_layer_norm = layer_norm(c.d_model, **norm)
        self.fc1 = dense(c.d_model, ffn, **kw)
        self.fc2 = dense(ffn, c.d_model, **kw)
        self.final_layer_norm = layer_norm(c.d_model, **norm)

    def __call__(self, x, mask, cross_kv=None, cross_mask=None, cache=None, cache_index=None):
        k, v = self.self_attn.kv(x)
        if cache is not None:  # write this call's keys and values at their slots, attend to all
            cache = {"k": write_cache(cache["k"], k, cache_index),
                     "v": write_cache(cache["v"], v, cache_index)}
            k, v = cache["k"], cache["v"]
        x = self.self_attn_layer_norm(x + self.self_attn(x, k, v, mask))
        if cross_kv is not None:
            x = self.encoder_attn_layer_norm(
                x + self.encoder_attn(x, cross_kv["k"], cross_kv["v"], cross_mask))
        x = self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))
        return x, cache


class BartStack(nnx.Module):
    """Positions, the embedding LayerNorm and the layers of the encoder or the decoder (the
    token embedding is the model's, shared by both)."""

    def __init__(self, config, *, decoder, rngs, param_dtype=jnp.float32):
        c = config
        self.config = c
        self.n_layers = n = c.decoder_layers if decoder else c.encoder_layers
        self.embed_positions = LearnedPositions(c.max_position_embeddings, c.d_model,
                                                offset=POSITION_OFFSET, dtype=c.dtype,
                                                param_dtype=param_dtype, rngs=rngs, std=c.init_std)
        self.layernorm_embedding = layer_norm(c.d_model, dtype=c.dtype, param_dtype=param_dtype,
                                              rngs=rngs)
        self.layers = stacked.make_layers(
            lambda i, r: BartLayer(c, decoder=decoder, rngs=r, param_dtype=param_dtype), n, rngs,
            c.scan_layers)

    def __call__(self, embedded, positions, mask, cross_kv=None, cross_mask=None, cache=None,
                 cache_index=None, encoder_hidden=None):
        """``cross_kv``: each decoder layer's cross-attention K/V
        (:meth:`BartForConditionalGeneration.cross_kv`); or ``encoder_hidden``, from which each
        layer computes its own (stacked layers without a cache: inside the scan, one at a
        time)."""
        c = self.config

        def call(layer, h, layer_cache, layer_kv=None):
            if layer_kv is None and encoder_hidden is not None:
                layer_kv = dict(zip(("k", "v"), layer.encoder_attn.kv(encoder_hidden)))
            return layer(h, mask, layer_kv, cross_mask, layer_cache, cache_index)

        x = self.layernorm_embedding(embedded + self.embed_positions(positions))
        return stacked.run_layers(self.layers, self.n_layers, x, cache, call,
                                  scanned=c.scan_layers, remat=c.remat, inputs=cross_kv)


class BartForConditionalGeneration(nnx.Module):
    """BART with its language-model head.

    ``model(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask=None)`` gives
    float32 logits [B, T_dec, vocab] (teacher forcing; see :func:`shift_right`); :meth:`encode`,
    :meth:`cross_kv` and :meth:`decode` are the pieces generation uses.
    """

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.config = c
        self.shared = nnx.Embed(c.vocab_size, c.d_model, dtype=c.dtype, param_dtype=param_dtype,
                                embedding_init=nnx.initializers.normal(c.init_std), rngs=rngs)
        self.encoder = BartStack(c, decoder=False, rngs=rngs, param_dtype=param_dtype)
        self.decoder = BartStack(c, decoder=True, rngs=rngs, param_dtype=param_dtype)
        self.final_logits_bias = nnx.Param(jnp.zeros((1, c.vocab_size), param_dtype))

    def _embed(self, ids):
        x = self.shared(ids)
        return x * (self.config.d_model ** 0.5) if self.config.scale_embedding else x

    def encode(self, input_ids, attention_mask=None):
        """Encoder output [B, S, d_model] (in the compute dtype); padding on either side."""
        b, s = input_ids.shape
        check_length(s, self.config.max_position_embeddings, "BART")
        h, _ = self.encoder(self._embed(input_ids), jnp.arange(s)[None],
                            key_mask(attention_mask, b, s))
        return h

    def cross_kv(self, encoder_hidden):
        """Every decoder layer's cross-attention keys and values, computed once per input:
        {"layers": {"i": {"k": [B, S, heads, head_dim], "v": ...}}}."""
        c = self.config
        x = encoder_hidden.astype(c.dtype)
        return {"layers": {str(i): dict(zip(("k", "v"), stacked.layer_of(
            self.decoder.layers, i, c.scan_layers).encoder_attn.kv(x)))
            for i in range(c.decoder_layers)}}

    def decode(self, decoder_input_ids, encoder_hidden, encoder_mask=None, attention_mask=None,
               positions=None, cache=None, cache_index=None, cross_kv=None):
        """Decoder logits [B, T, vocab] float32 (and the new cache when ``cache`` is given).

        Token t sits at slot (and position) ``cache_index + t`` (``t`` without a cache) and
        attends causally to the slots whose ``attention_mask`` is 1 ([B, T] without a cache,
        [B, S_max] with one). ``positions`` is accepted for the common decoder protocol and
        unused: BART's decoder positions are its slots. ``cross_kv`` (from :meth:`cross_kv`)
        saves recomputing the cross-attention keys and values.
        """
        del positions
        c = self.config
        b, t = decoder_input_ids.shape
        # stacked layers without a cache compute their cross-attention K/V inside the scan
        in_scan = c.scan_layers and cache is None and cross_kv is None
        if cross_kv is None and not in_scan:
            cross_kv = self.cross_kv(encoder_hidden)
        enc_len = encoder_hidden.shape[1] if in_scan else cross_kv["layers"]["0"]["k"].shape[1]
        if cache is None:
            query_slots, n_keys = jnp.arange(t), t
        else:
            if cache_index is None:
                raise ConfigError("decode(cache=...) needs cache_index, the slot of the first "
                                  "new token.")
            query_slots = cache_index + jnp.arange(t)
            n_keys = cache["layers"]["0"]["k"].shape[1]
            check_length(n_keys, c.max_position_embeddings, "BART")
        valid = jnp.ones((b, n_keys), jnp.int32) if attention_mask is None else attention_mask
        mask = causal_mask(query_slots, jnp.arange(n_keys), valid)
        h, new_cache = self.decoder(self._embed(decoder_input_ids), query_slots[None], mask,
                                    cross_kv, key_mask(encoder_mask, b, enc_len), cache,
                                    cache_index,
                                    encoder_hidden.astype(c.dtype) if in_scan else None)
        logits = self.shared.attend(h) + self.final_logits_bias[...].astype(h.dtype)
        logits = logits.astype(jnp.float32)
        return logits if cache is None else (logits, new_cache)

    def __call__(self, input_ids, attention_mask=None, decoder_input_ids=None,
                 decoder_attention_mask=None):
        if decoder_input_ids is None:
            raise ConfigError("BART needs decoder_input_ids (the targets shifted right, starting "
                              "with config.decoder_start_token_id); see shift_right().")
        encoder_hidden = self.encode(input_ids, attention_mask)
        return self.decode(decoder_input_ids, encoder_hidden, attention_mask,
                           attention_mask=decoder_attention_mask)

    def init_cache(self, batch_size, max_length, dtype=jnp.float32):
        """Zeroed decoder self-attention cache:
        {"layers": {"i": {"k": [B, S, heads, head_dim], "v": ...}}}."""
        c = self.config
        check_length(max_length, c.max_position_embeddings, "BART")
        heads = c.decoder_attention_heads
        return empty_kv_cache(c.decoder_layers, batch_size, max_length, heads,
                              c.d_model // heads, dtype)


def shift_right(labels, config):
    """Decoder inputs for teacher forcing: ``decoder_start_token_id`` then ``labels[:, :-1]``,
    with the loss-ignore value -100 replaced by the pad id."""
    labels = jnp.where(labels == -100, config.pad_token_id, labels)
    start = jnp.full((labels.shape[0], 1), config.decoder_start_token_id, labels.dtype)
    return jnp.concatenate([start, labels[:, :-1]], axis=1)


MODULES = {"BartForConditionalGeneration": BartForConditionalGeneration}
DEFAULT_MODULE = BartForConditionalGeneration


def hf_sources(config, module_cls=BartForConditionalGeneration):
    """Tensor names as transformers saves BartForConditionalGeneration. The shared embedding is
    also read from the per-stack copies some released folders store instead."""
    def linear(name):
        return {"kernel": hf.Source(f"{name}.weight", transpose=True),
                "bias": hf.Source(f"{name}.bias")}

    def norm(name):
        return {"scale": hf.Source(f"{name}.weight"), "bias": hf.Source(f"{name}.bias")}

    def attention(name):
        return {n: linear(f"{name}.{n}") for n in ("q_proj", "k_proj", "v_proj", "out_proj")}

    def stack(side, n, decoder):
        p = f"model.{side}"

        def layer(i):
            q = f"{p}.layers.{i}"
            out = {"self_attn": attention(f"{q}.self_attn"),
                   "self_attn_layer_norm": norm(f"{q}.self_attn_layer_norm"),
                   "fc1": linear(f"{q}.fc1"), "fc2": linear(f"{q}.fc2"),
                   "final_layer_norm": norm(f"{q}.final_layer_norm")}
            if decoder:
                out["encoder_attn"] = attention(f"{q}.encoder_attn")
                out["encoder_attn_layer_norm"] = norm(f"{q}.encoder_attn_layer_norm")
            return out

        return {"embed_positions": {"table": {"embedding": hf.Source(
                    f"{p}.embed_positions.weight")}},
                "layernorm_embedding": norm(f"{p}.layernorm_embedding"),
                "layers": stacked.layer_sources(layer, n, config.scan_layers)}

    return {"shared": {"embedding": hf.Source("model.shared.weight", aliases=(
                "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"))},
            "encoder": stack("encoder", config.encoder_layers, False),
            "decoder": stack("decoder", config.decoder_layers, True),
            "final_logits_bias": hf.Source("final_logits_bias")}


def example_inputs(config, module_cls=BartForConditionalGeneration, batch=2, length=8):
    """Abstract (input_ids, attention_mask, decoder_input_ids) for tracing the sharding plan."""
    ids = jax.ShapeDtypeStruct((batch, min(length, config.max_position_embeddings)), jnp.int32)
    return ids, ids, ids
