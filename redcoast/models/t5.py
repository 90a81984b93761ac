"""T5 (v1.0, v1.1, flan-t5) as a Flax NNX encoder-decoder with Hugging Face weights.

T5 differs from the decoder-only families in four ways that shape this file:

- positions enter only as a learned per-head bias on the attention scores, looked up from a
  bucketed key-minus-query offset; the first block of each stack owns the table and the other
  blocks reuse the same bias (bidirectional buckets in the encoder, causal ones in the decoder);
- attention scores are not scaled by 1/sqrt(d_kv) (T5 folds that into the query's initialisation);
- its layer norm is RMS-only (no mean, no bias), applied before each sub-layer;
- v1.0 ties the LM head to the embedding and scales the decoder output by d_model**-0.5 first;
  v1.1 / flan-t5 keep a separate ``lm_head`` and use a gated-GELU feed-forward.

Decoding with a cache stores only the decoder's self-attention keys and values
(:meth:`T5ForConditionalGeneration.init_cache`). Cross-attention keys and values depend only on
the encoder output, so :meth:`T5ForConditionalGeneration.cross_kv` computes them once per input
and ``decode(..., cross_kv=...)`` reuses them; without ``cross_kv`` they are recomputed from
``encoder_hidden`` on every call (correct, just slower).
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..errors import ConfigError
from . import hf, stacked
from .activations import ACTIVATIONS
from .hf import Source
from .layers import RMSNorm, write_cache

@dataclass(frozen=True)
class Config:
    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None  # None: as many as the encoder
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"  # "relu" (v1.0), "gated-gelu" (v1.1, flan-t5), "gated-silu"
    tie_word_embeddings: bool = True  # no lm_head of its own: the LM head is the embedding
    # multiply the decoder output by d_model**-0.5 before the head; None: when tied (v1.0)
    scale_decoder_outputs: bool | None = None
    decoder_start_token_id: int = 0
    pad_token_id: int = 0
    eos_token_id: int | tuple = 1
    dtype: Any = jnp.float32
    remat: bool = False
    scan_layers: bool = False  # the blocks of each stack stacked and run by a scan (stacked.py)

    def __post_init__(self):
        if self.num_decoder_layers is None:
            object.__setattr__(self, "num_decoder_layers", self.num_layers)
        if self.scale_decoder_outputs is None:
            object.__setattr__(self, "scale_decoder_outputs", self.tie_word_embeddings)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self.activation  # noqa: B018 -- fail early on an unknown feed_forward_proj

    @property
    def is_gated(self):
        return self.feed_forward_proj.startswith("gated-")

    @property
    def activation(self):
        name = self.feed_forward_proj.removeprefix("gated-")
        if self.feed_forward_proj == "gated-gelu":
            name = "gelu_new"  # what T5 v1.1 was trained with, whatever "gelu" means elsewhere
        if name not in ACTIVATIONS or "-" in name:
            raise ConfigError(f"feed_forward_proj={self.feed_forward_proj!r} is not supported; use "
                              f"one of {sorted(ACTIVATIONS)}, optionally as 'gated-<name>'.")
        return ACTIVATIONS[name]

    @classmethod
    def from_hf(cls, d):
        tied = d.get("tie_word_embeddings", True)
        eos = d.get("eos_token_id", 1)
        return cls(
            vocab_size=d["vocab_size"], d_model=d["d_model"], d_kv=d["d_kv"], d_ff=d["d_ff"],
            num_layers=d["num_layers"], num_decoder_layers=d.get("num_decoder_layers"),
            num_heads=d["num_heads"],
            relative_attention_num_buckets=d.get("relative_attention_num_buckets", 32),
            relative_attention_max_distance=d.get("relative_attention_max_distance", 128),
            layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-6),
            feed_forward_proj=d.get("feed_forward_proj", "relu"),
            tie_word_embeddings=tied,
            # transformers 5 writes it; older configs mean "scale when tied"
            scale_decoder_outputs=d.get("scale_decoder_outputs", tied),
            decoder_start_token_id=_first_set(d.get("decoder_start_token_id"),
                                              d.get("pad_token_id"), 0),
            pad_token_id=_first_set(d.get("pad_token_id"), 0),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos)

    def to_hf(self):
        return {
            "model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
            "is_encoder_decoder": True, "vocab_size": self.vocab_size, "d_model": self.d_model,
            "d_kv": self.d_kv, "d_ff": self.d_ff, "num_layers": self.num_layers,
            "num_decoder_layers": self.num_decoder_layers, "num_heads": self.num_heads,
            "relative_attention_num_buckets": self.relative_attention_num_buckets,
            "relative_attention_max_distance": self.relative_attention_max_distance,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "feed_forward_proj": self.feed_forward_proj,
            "tie_word_embeddings": self.tie_word_embeddings,
            "scale_decoder_outputs": self.scale_decoder_outputs,
            "decoder_start_token_id": self.decoder_start_token_id,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": (list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                             else self.eos_token_id),
            "dropout_rate": 0.0,
        }


def _first_set(*values):
    return next(v for v in values if v is not None)


def config_for_tensors(config, reader):
    """``config`` corrected by what the folder holds.

    transformers 5 always writes ``tie_word_embeddings: true`` for T5 and keeps a separate
    ``lm_head.weight`` only when it differs from the embedding, so the tensors, not config.json,
    say whether the head is tied."""
    untied = "lm_head.weight" in reader
    if untied == (not config.tie_word_embeddings):
        return config
    return dataclasses.replace(config, tie_word_embeddings=not untied)  # scaling as it was


# ---- relative position buckets -------------------------------------------------------------------

def bucket_table(num_buckets, max_distance, bidirectional):
    """Bucket of every key-minus-query offset in [-max_distance, max_distance] (index offset +
    max_distance); offsets beyond that range share the end buckets, so clipping to it is exact.

    Computed once on the host in float32, the precision the buckets were defined in."""
    rel = np.arange(-max_distance, max_distance + 1)
    bucket = np.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        bucket += (rel > 0) * num_buckets
        dist = np.abs(rel)
    else:
        dist = np.maximum(-rel, 0)  # keys after the query are masked; they share bucket 0
    exact = num_buckets // 2
    ratio = np.maximum(dist, 1).astype(np.float32) / np.float32(exact)
    log_ratio = np.log(ratio) / np.float32(np.log(max_distance / exact))
    large = exact + (log_ratio * np.float32(num_buckets - exact)).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    return (bucket + np.where(dist < exact, dist, large)).astype(np.int32)


class RelativeBias(nnx.Module):
    """Per-head bias [1, heads, queries, keys] from the bucketed offset key - query."""

    def __init__(self, config, *, bidirectional, rngs, param_dtype=jnp.float32):
        self.config = config
        self.bidirectional = bidirectional
        self.embedding = nnx.Param(nnx.initializers.normal(config.d_model ** -0.5)(
            rngs.params(), (config.relative_attention_num_buckets, config.num_heads), param_dtype))

    def __call__(self, query_pos, key_pos):
        c = self.config
        table = jnp.asarray(bucket_table(c.relative_attention_num_buckets,
                                         c.relative_attention_max_distance, self.bidirectional))
        md = c.relative_attention_max_distance
        rel = jnp.clip(key_pos[None, :] - query_pos[:, None], -md, md) + md
        bias = jnp.take(self.embedding[...], table[rel], axis=0)  # [T, S, heads]
        return jnp.transpose(bias, (2, 0, 1))[None].astype(c.dtype)


# ---- layers --------------------------------------------------------------------------------------

def _norm(config, param_dtype):
    # T5's layer norm is RMS-only: no mean, no bias
    return RMSNorm(config.d_model, eps=config.layer_norm_epsilon, dtype=config.dtype,
                   param_dtype=param_dtype)


def _linear(n_in, n_out, std, config, rngs, param_dtype):
    return nnx.Linear(n_in, n_out, use_bias=False, dtype=config.dtype, param_dtype=param_dtype,
                      kernel_init=nnx.initializers.normal(std), rngs=rngs)


class Attention(nnx.Module):
    """Multi-head attention with unscaled scores plus the relative-position bias."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        inner = c.num_heads * c.d_kv
        self.heads, self.d_kv = c.num_heads, c.d_kv
        self.q = _linear(c.d_model, inner, (c.d_model * c.d_kv) ** -0.5, c, rngs, param_dtype)
        self.k = _linear(c.d_model, inner, c.d_model ** -0.5, c, rngs, param_dtype)
        self.v = _linear(c.d_model, inner, c.d_model ** -0.5, c, rngs, param_dtype)
        self.o = _linear(inner, c.d_model, inner ** -0.5, c, rngs, param_dtype)

    def _heads(self, x):
        return x.reshape(*x.shape[:-1], self.heads, self.d_kv)

    def kv(self, x):
        """Keys and values [B, S, heads, d_kv] of ``x``."""
        return self._heads(self.k(x)), self._heads(self.v(x))

    def __call__(self, x, k, v, bias, mask):
        q = self._heads(self.q(x))
        out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), bias=bias,
                                           mask=mask, scale=1.0)
        return self.o(out.reshape(*out.shape[:-2], self.heads * self.d_kv))


class FeedForward(nnx.Module):
    """wo(act(wi x)) in v1.0; wo(act(wi_0 x) * wi_1 x) in the gated variants."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.act = c.activation
        if c.is_gated:
            self.wi_0 = _linear(c.d_model, c.d_ff, c.d_model ** -0.5, c, rngs, param_dtype)
            self.wi_1 = _linear(c.d_model, c.d_ff, c.d_model ** -0.5, c, rngs, param_dtype)
        else:
            self.wi = _linear(c.d_model, c.d_ff, c.d_model ** -0.5, c, rngs, param_dtype)
        self.wo = _linear(c.d_ff, c.d_model, c.d_ff ** -0.5, c, rngs, param_dtype)

    def __call__(self, x):
        if hasattr(self, "wi"):
            return self.wo(self.act(self.wi(x)))
        return self.wo(self.act(self.wi_0(x)) * self.wi_1(x))


class Block(nnx.Module):
    """Self-attention, cross-attention (decoder only) and feed-forward, each pre-normed and
    added to the residual stream."""

    def __init__(self, config, *, cross, rngs, param_dtype=jnp.float32):
        self.self_norm = _norm(config, param_dtype)
        self.self_attn = Attention(config, rngs=rngs, param_dtype=param_dtype)
        if cross:
            self.cross_norm = _norm(config, param_dtype)
            self.cross_attn = Attention(config, rngs=rngs, param_dtype=param_dtype)
        self.mlp_norm = _norm(config, param_dtype)
        self.mlp = FeedForward(config, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, h, bias, mask, cross_kv=None, cross_mask=None, cache=None, cache_index=None):
        x = self.self_norm(h)
        k, v = self.self_attn.kv(x)
        new_cache = None
        if cache is not None:  # write this call's keys and values at their slots, attend to all
            k = write_cache(cache["k"], k, cache_index)
            v = write_cache(cache["v"], v, cache_index)
            new_cache = {"k": k, "v": v}
        h = h + self.self_attn(x, k, v, bias, mask)
        if cross_kv is not None:
            h = h + self.cross_attn(self.cross_norm(h), cross_kv["k"], cross_kv["v"], None,
                                    cross_mask)
        h = h + self.mlp(self.mlp_norm(h))
        return h, new_cache


class Stack(nnx.Module):
    """The encoder (bidirectional) or the decoder (causal, with cross-attention)."""

    def __init__(self, config, *, decoder, rngs, param_dtype=jnp.float32):
        self.config = config
        n = config.num_decoder_layers if decoder else config.num_layers
        self.relative_attention_bias = RelativeBias(config, bidirectional=not decoder, rngs=rngs,
                                                    param_dtype=param_dtype)
        if config.scan_layers:
            self.blocks = stacked.stacked_layers(
                lambda r: Block(config, cross=decoder, rngs=r, param_dtype=param_dtype), n, rngs)
        else:
            self.blocks = nnx.List([Block(config, cross=decoder, rngs=rngs,
                                          param_dtype=param_dtype) for _ in range(n)])
        self.n_blocks = n
        self.final_norm = _norm(config, param_dtype)

    def __call__(self, h, bias, mask, cross_kv=None, cross_mask=None, cache=None, cache_index=None,
                 encoder_hidden=None):
        """``cross_kv``: each layer's cross-attention K/V (:meth:`T5ForConditionalGeneration.
        cross_kv`); or, stacked blocks without a cache, ``encoder_hidden``, from which each
        block computes its own inside the scan."""
        c = self.config
        if c.scan_layers and cache is None and cross_kv is None:
            def body(blk, x):
                kv = None
                if encoder_hidden is not None:
                    k, v = blk.cross_attn.kv(encoder_hidden.astype(c.dtype))
                    kv = {"k": k, "v": v}
                return blk(x, bias, mask, kv, cross_mask)[0]
            return self.final_norm(stacked.scan_layers(self.blocks, h, body, remat=c.remat)), None
        call = (lambda blk, *a: blk(*a))
        if c.remat:
            call = nnx.remat(call)
        new_cache = None if cache is None else {"layers": {}}
        for i in range(self.n_blocks):
            block = self.block(i)
            layer_cache = None if cache is None else cache["layers"][str(i)]
            layer_kv = None if cross_kv is None else cross_kv["layers"][str(i)]
            h, layer_new = call(block, h, bias, mask, layer_kv, cross_mask, layer_cache,
                                cache_index)
            if cache is not None:
                new_cache["layers"][str(i)] = layer_new
        return self.final_norm(h), new_cache

    def block(self, i):
        """Block ``i`` as a module of its own (of the stack, when the blocks are stacked)."""
        return stacked.layer_at(self.blocks, i) if self.config.scan_layers else self.blocks[i]


# ---- the model -----------------------------------------------------------------------------------

def _key_mask(mask, batch, length):
    """A [B, 1, 1, S] boolean mask from a [B, S] 1/0 mask (all true when None)."""
    if mask is None:
        return jnp.ones((batch, 1, 1, length), bool)
    return mask.astype(bool)[:, None, None, :]


class T5ForConditionalGeneration(nnx.Module):
    """T5 encoder-decoder with its language-model head.

    ``model(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask=None)`` gives
    float32 logits [B, T_dec, vocab] (teacher forcing); :meth:`encode`, :meth:`cross_kv` and
    :meth:`decode` are the pieces generation uses.
    """

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.config = c
        self.shared = nnx.Embed(c.vocab_size, c.d_model, dtype=c.dtype, param_dtype=param_dtype,
                                embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.encoder = Stack(c, decoder=False, rngs=rngs, param_dtype=param_dtype)
        self.decoder = Stack(c, decoder=True, rngs=rngs, param_dtype=param_dtype)
        if not c.tie_word_embeddings:
            self.lm_head = _linear(c.d_model, c.vocab_size, 1.0, c, rngs, param_dtype)

    def encode(self, input_ids, attention_mask=None):
        """Encoder output [B, S, d_model] (in the compute dtype)."""
        s = input_ids.shape[1]
        pos = jnp.arange(s)
        bias = self.encoder.relative_attention_bias(pos, pos)
        mask = _key_mask(attention_mask, input_ids.shape[0], s)
        h, _ = self.encoder(self.shared(input_ids), bias, mask)
        return h

    def cross_kv(self, encoder_hidden):
        """Every decoder layer's cross-attention keys and values, computed once per input:
        {"layers": {"i": {"k": [B, S, heads, d_kv], "v": ...}}}."""
        out = {}
        for i in range(self.decoder.n_blocks):
            k, v = self.decoder.block(i).cross_attn.kv(encoder_hidden.astype(self.config.dtype))
            out[str(i)] = {"k": k, "v": v}
        return {"layers": out}

    def decode(self, decoder_input_ids, encoder_hidden, encoder_mask=None, attention_mask=None,
               positions=None, cache=None, cache_index=None, cross_kv=None):
        """Decoder logits [B, T, vocab] float32 (and the new cache when ``cache`` is given).

        Without a cache: causal self-attention over ``decoder_input_ids``, ``attention_mask`` [B, T]
        masking padded keys. With one (see :meth:`init_cache`): token t is written at slot
        ``cache_index + t`` and attends to slots up to its own whose ``attention_mask`` [B, S_max]
        is 1. ``positions`` is accepted for the common decoder protocol but unused: T5's only
        position signal is the key-minus-query offset, which for the contiguous tokens of a
        row is the slot offset. ``cross_kv`` (from :meth:`cross_kv`) saves recomputing the
        cross-attention keys and values; ``encoder_hidden`` may then be None.
        """
        del positions
        c = self.config
        b, t = decoder_input_ids.shape
        # stacked blocks without a cache compute their cross-attention K/V inside the scan
        in_scan = c.scan_layers and cache is None and cross_kv is None
        if cross_kv is None and not in_scan:
            cross_kv = self.cross_kv(encoder_hidden)
        enc_len = (encoder_hidden.shape[1] if in_scan else
                   cross_kv["layers"]["0"]["k"].shape[1] if cross_kv["layers"] else 0)
        cross_mask = _key_mask(encoder_mask, b, enc_len)
        if cache is None:
            q_pos = k_pos = jnp.arange(t)
        else:
            if cache_index is None:
                raise ConfigError("decode(cache=...) needs cache_index, the slot of the first "
                                  "new token.")
            q_pos = cache_index + jnp.arange(t)
            k_pos = jnp.arange(cache["layers"]["0"]["k"].shape[1])
        # a padded query still attends to the real keys before it (as transformers does), so
        # the logits match at every position
        mask = (_key_mask(attention_mask, b, k_pos.shape[0])
                & (k_pos[None, :] <= q_pos[:, None])[None, None])
        bias = self.decoder.relative_attention_bias(q_pos, k_pos)
        h, new_cache = self.decoder(self.shared(decoder_input_ids), bias, mask, cross_kv,
                                    cross_mask, cache, cache_index,
                                    encoder_hidden=encoder_hidden if in_scan else None)
        if c.scale_decoder_outputs:
            h = h * (c.d_model ** -0.5)
        logits = self.shared.attend(h) if c.tie_word_embeddings else self.lm_head(h)
        logits = logits.astype(jnp.float32)
        return logits if cache is None else (logits, new_cache)

    def __call__(self, input_ids, attention_mask=None, decoder_input_ids=None,
                 decoder_attention_mask=None):
        if decoder_input_ids is None:
            raise ConfigError("T5 needs decoder_input_ids (the targets shifted right, starting "
                              "with config.decoder_start_token_id); see shift_right().")
        encoder_hidden = self.encode(input_ids, attention_mask)
        return self.decode(decoder_input_ids, encoder_hidden, attention_mask,
                           attention_mask=decoder_attention_mask)

    def init_cache(self, batch_size, max_length, dtype=jnp.float32):
        """Zeroed decoder self-attention cache:
        {"layers": {"i": {"k": [B, S, heads, d_kv], "v": ...}}}."""
        c = self.config
        shape = (batch_size, max_length, c.num_heads, c.d_kv)
        return {"layers": {str(i): {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                           for i in range(c.num_decoder_layers)}}


def shift_right(labels, config):
    """Decoder inputs for teacher forcing: ``decoder_start_token_id`` then ``labels[:, :-1]``,
    with the loss-ignore value -100 replaced by the pad id."""
    labels = jnp.where(labels == -100, config.pad_token_id, labels)
    start = jnp.full((labels.shape[0], 1), config.decoder_start_token_id, labels.dtype)
    return jnp.concatenate([start, labels[:, :-1]], axis=1)


MODULES = {"T5ForConditionalGeneration": T5ForConditionalGeneration}
DEFAULT_MODULE = T5ForConditionalGeneration


# ---- Hugging Face tensor names -------------------------------------------------------------------

def _attention_sources(prefix):
    return {name: {"kernel": Source(f"{prefix}.{name}.weight", transpose=True)}
            for name in ("q", "k", "v", "o")}


def _block_sources(config, stack, i, decoder):
    p = f"{stack}.block.{i}.layer"
    ff = 2 if decoder else 1
    mlp = (("wi_0", "wi_1", "wo") if config.is_gated else ("wi", "wo"))
    out = {
        "self_norm": {"scale": Source(f"{p}.0.layer_norm.weight")},
        "self_attn": _attention_sources(f"{p}.0.SelfAttention"),
        "mlp_norm": {"scale": Source(f"{p}.{ff}.layer_norm.weight")},
        "mlp": {name: {"kernel": Source(f"{p}.{ff}.DenseReluDense.{name}.weight", transpose=True)}
                for name in mlp},
    }
    if decoder:
        out["cross_norm"] = {"scale": Source(f"{p}.1.layer_norm.weight")}
        out["cross_attn"] = _attention_sources(f"{p}.1.EncDecAttention")
    return out


def _stack_sources(config, stack, decoder):
    n = config.num_decoder_layers if decoder else config.num_layers
    return {
        "relative_attention_bias": {"embedding": Source(
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")},
        "blocks": (hf.stack_sources([_block_sources(config, stack, i, decoder) for i in range(n)])
                   if config.scan_layers else
                   {str(i): _block_sources(config, stack, i, decoder) for i in range(n)}),
        "final_norm": {"scale": Source(f"{stack}.final_layer_norm.weight")},
    }


def hf_sources(config, module_cls=T5ForConditionalGeneration):
    """Which Hugging Face tensor fills each parameter (mirrors ``abstract_params()``)."""
    out = {
        "shared": {"embedding": Source("shared.weight")},
        "encoder": _stack_sources(config, "encoder", decoder=False),
        "decoder": _stack_sources(config, "decoder", decoder=True),
    }
    if not config.tie_word_embeddings:
        out["lm_head"] = {"kernel": Source("lm_head.weight", transpose=True)}
    return out


def example_inputs(config, module_cls=T5ForConditionalGeneration, batch=2, length=8):
    """Abstract (input_ids, attention_mask, decoder_input_ids) for tracing the sharding plan."""
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    return ids, ids, ids
