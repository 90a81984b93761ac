"""Generation for encoder-decoder models (T5): the input is encoded once, then the decoder runs
generate.py's loop (greedy, sampling or beam search) with its self-attention cache.

The model (a :class:`redcoast.models.Model`) provides, besides ``init_cache(batch, max_length,
dtype)``:

- ``encode(input_ids, attention_mask)`` -> encoder output [B, S, d];
- ``cross_kv(encoder_hidden)`` -> the decoder's cross-attention keys and values (batch first),
  computed once here instead of once per generated token;
- ``decode(ids, encoder_hidden, encoder_mask, attention_mask=, cache=, cache_index=, cross_kv=)``
  -> ``(logits, new_cache)``;

and its config a ``decoder_start_token_id``. Decoder slot 0 holds the start token and slot i the
i-th generated token, so every row writes the same slot at each step (no padding on the decoder
side); the encoder input may be padded on either side.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError, DataError
from .generate import check_token_ids, decode
from .search_parts import last_logits, search_config


def seq2seq_step(model):
    """generate.decode's ``step_fn``: one decoder token per row against the cached encoder."""
    def step(params, tokens, positions, key_mask, cache, cache_index, extra):
        logits, cache = model.apply(params, tokens, None, extra["encoder_mask"],
                                    attention_mask=key_mask, cache=cache, cache_index=cache_index,
                                    cross_kv=extra["cross_kv"], method="decode")
        return last_logits(logits), cache
    return step


def _generate(model, cfg, start_id, params, input_ids, attention_mask, rng):
    batch = input_ids.shape[0]
    if attention_mask is None:  # (for images, [B, C]: unused by vision encoders)
        attention_mask = jnp.ones(input_ids.shape[:2], jnp.int32)
    attention_mask = attention_mask.astype(jnp.int32)
    encoder_hidden = model.apply(params, input_ids, attention_mask, method="encode")
    extra = {"cross_kv": model.apply(params, encoder_hidden, method="cross_kv"),
             "encoder_mask": attention_mask}
    # slots: the start token, then every generated token but the last (never fed back)
    n_slots = cfg.max_new_tokens
    cache = model.init_cache(batch, n_slots, dtype=getattr(model.config, "dtype", jnp.float32))
    key_mask = jnp.ones((batch, n_slots), jnp.int32)
    start = jnp.full((batch, 1), start_id, jnp.int32)
    logits, cache = seq2seq_step(model)(params, start, None, key_mask, cache, jnp.int32(0), extra)
    return decode(seq2seq_step(model), params, logits, cache, key_mask,
                  jnp.ones((batch,), jnp.int32), jnp.int32(1), extra, config=cfg, rng=rng,
                  context=start)


@functools.lru_cache(maxsize=64)
def _jitted(model, cfg, start_id):
    return jax.jit(functools.partial(_generate, model, cfg, start_id))


def generate(model, params, input_ids, attention_mask=None, *, max_new_tokens, do_sample=None,
             temperature=None, top_k=None, top_p=None, num_beams=None, length_penalty=None,
             early_stopping=None, eos_token_id=None, pad_token_id=None,
             decoder_start_token_id=None, repetition_penalty=None, min_new_tokens=None,
             min_length=None, no_repeat_ngram_size=None, forced_bos_token_id=None,
             forced_eos_token_id=None, stop_sequences=(), rng=None):
    """Decoder tokens for a batch of inputs: int32 [B, max_new_tokens] (the start token not
    included), each row padded with ``pad_token_id`` after its first EOS.

    ``eos_token_id`` and ``pad_token_id`` default as in :func:`redcoast.models.generate.generate`
    (the folder's generation_config.json, then the config), ``decoder_start_token_id`` to the
    config's. The search options and transformers' processors are that function's (the
    decoder's history for the processors starts with the start token, so ``min_length`` counts
    it, as in transformers: BART-CNN's ``min_length=56`` is 55 new tokens): greedy by default,
    ``do_sample=True`` (with ``rng``), ``num_beams > 1`` for beam search, with every processor.
    Works inside a jitted ``pred_fn`` and called directly (compiled once per model, setting and shape).
    """
    config = model.config
    given = dict(
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
        num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping,
        repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens,
        min_length=min_length, no_repeat_ngram_size=no_repeat_ngram_size,
        forced_bos_token_id=forced_bos_token_id, forced_eos_token_id=forced_eos_token_id)
    cfg = search_config(model, given, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                        pad_token_id=pad_token_id, stop_sequences=stop_sequences, rng=rng,
                        context_width=1)  # the decoder's start token
    start_id = config.decoder_start_token_id if decoder_start_token_id is None else (
        decoder_start_token_id)
    if cfg.do_sample and rng is None:
        raise ConfigError("do_sample=True needs rng=<a jax.random key> (a Predictor's pred_fn "
                          "receives one as its first argument).")
    input_ndim = getattr(config, "input_ndim", 2)  # 4: images [B, C, H, W] (vision encoders)
    if np.ndim(input_ids) != input_ndim:
        raise DataError(f"input_ids has shape {np.shape(input_ids)}; generate expects "
                        + ("[batch, input length]." if input_ndim == 2 else
                           f"{input_ndim} dimensions (pixel_values [batch, channels, height, width])."))
    if attention_mask is not None and np.shape(attention_mask) != np.shape(input_ids):
        raise DataError(f"attention_mask has shape {np.shape(attention_mask)}, input_ids "
                        f"{np.shape(input_ids)}; they must match.")
    if input_ndim == 2:  # token ids (images are pixels)
        check_token_ids(input_ids, model)
    return _jitted(model, cfg, int(start_id))(params, jnp.asarray(input_ids), attention_mask, rng)
