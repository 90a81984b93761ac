"""Text generation with a KV cache: greedy, sampling (temperature, top-k, top-p) and beam search.

Everything is pure JAX with fixed shapes, so :func:`generate` works inside a user's ``pred_fn``
(which redcoast's Predictor jits with sharded parameters and a batch split over 'dp') and also
when called directly, where it is jit-compiled once per model, setting and input shape.

The prompt is prefilled in one call (its last token in a second one, so that only its logits
are computed), then one token per step is decoded in a ``lax.while_loop`` that stops as soon
as every row has finished. Prompts are LEFT-padded (:func:`left_pad`), so every row's next
token goes into the same cache slot.

Encoder-decoder families reuse the loop through :func:`decode` with their own ``step_fn``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import ConfigError, DataError
from . import logits_processors as processors
from .beam import beam_search
from .search_parts import is_eos, last_logits, row_keys, search_config, warp


def left_pad(token_lists, pad_id=0, length=None):
    """``(input_ids, attention_mask)`` int32 numpy arrays [B, L] with each prompt at the right end.

    ``length`` pads to a fixed width (fewer compilations); by default the longest prompt's."""
    longest = max((len(t) for t in token_lists), default=0)
    length = longest if length is None else int(length)
    if longest > length:
        raise DataError(f"a prompt has {longest} tokens, more than length={length}. Fix: raise "
                        "length or truncate the prompts.")
    ids = np.full((len(token_lists), length), pad_id, np.int32)
    mask = np.zeros((len(token_lists), length), np.int32)
    for row, tokens in enumerate(token_lists):
        if len(tokens):
            ids[row, length - len(tokens):] = tokens
            mask[row, length - len(tokens):] = 1
    return ids, mask


# ---------------------------------------------------------------------------- the decoding loop

def decode(step_fn, params, logits, cache, key_mask, positions, cache_index, extra=None, *,
           config, rng=None, context=None, context_mask=None):
    """Generate ``config.max_new_tokens`` tokens after a prefill: int32 [B, max_new_tokens].

    The hook for every family (decoder-only and encoder-decoder):

    - ``logits`` [B, V]: the prefill's prediction of the first new token;
    - ``cache``: the model's KV cache after the prefill, every leaf with batch on axis 0;
    - ``key_mask`` [B, S]: which cache slots hold (or will hold) real tokens; constant while
      decoding, so the slots of the tokens still to come are already 1;
    - ``positions`` [B] int32: the position of the first new token; ``cache_index``: its slot
      (int32 scalar, the same for all rows);
    - ``extra``: any per-row pytree (batch on axis 0) that ``step_fn`` needs, e.g. an encoder's
      outputs and their mask; it is expanded to beams with the cache. Beam reordering only
      moves hypotheses within one prompt's beams, and those share ``extra``, so it is not
      reordered.
    - ``step_fn(params, tokens[N, 1], positions[N, 1], key_mask, cache, cache_index, extra)``
      -> ``(logits [N, V] (or [N, 1, V]), new_cache)`` runs one token per row.

    The cache needs ``cache_index + max_new_tokens - 1`` slots (the last token is never fed
    back); ``rng`` is required when ``config.do_sample``. ``context`` [B, C] (and its
    ``context_mask``) are the tokens before the new ones, which the logits processors
    (repetition penalty, n-grams, min_length, forced BOS) look back on: the prompt of a decoder,
    the start token of an encoder-decoder's decoder.
    """
    if config.do_sample and rng is None:
        raise ConfigError("do_sample=True needs rng=<a jax.random key> (a Predictor's pred_fn "
                          "receives one as its first argument).")
    if context is None:
        context = jnp.zeros((logits.shape[0], 0), jnp.int32)
    if context_mask is None:
        context_mask = jnp.ones(context.shape, bool)
    if config.num_beams > 1:
        return beam_search(step_fn, params, logits, cache, key_mask, positions, cache_index,
                           extra, config=config, rng=rng, context=context,
                           context_mask=context_mask.astype(bool))
    return _sample_or_greedy(step_fn, params, logits, cache, key_mask, positions, cache_index,
                             extra, config, rng, context, context_mask.astype(bool))


def _sample_or_greedy(step_fn, params, logits, cache, key_mask, positions, cache_index, extra,
                      cfg, rng, context, context_mask):
    batch, n_new = logits.shape[0], cfg.max_new_tokens
    keys = row_keys(rng, batch) if cfg.do_sample else None

    def choose(logits, i, finished, out):
        logits = logits.astype(jnp.float32)
        if processors.any_active(cfg):
            ids, valid = processors.history(context, context_mask, out, i)
            logits = processors.process(logits, cfg, i, ids, valid, context.shape[1])
        if cfg.do_sample:
            step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)
            tokens = jax.vmap(jax.random.categorical)(step_keys, warp(logits, cfg))
        else:
            tokens = jnp.argmax(logits, axis=-1)
        return jnp.where(finished, cfg.pad_token_id, tokens.astype(jnp.int32))

    def write(out, finished, tokens, i):
        out = lax.dynamic_update_slice(out, tokens[:, None], (0, i))
        stopped = processors.ends_with_a_stop_sequence(out, i, cfg.stop_sequences)
        return out, finished | is_eos(tokens, cfg) | stopped

    none_finished = jnp.zeros((batch,), bool)
    out = jnp.full((batch, n_new), cfg.pad_token_id, jnp.int32)
    out, finished = write(out, none_finished, choose(logits, 0, none_finished, out), 0)

    def cond(carry):
        i, _, finished, _ = carry
        return (i < n_new) & ~jnp.all(finished)

    def body(carry):
        i, out, finished, cache = carry
        previous = lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
        logits, cache = step_fn(params, previous, (positions + i - 1)[:, None], key_mask, cache,
                                cache_index + i - 1, extra)
        out, finished = write(out, finished, choose(last_logits(logits), i, finished, out), i)
        return i + 1, out, finished, cache

    _, out, _, _ = lax.while_loop(cond, body, (jnp.int32(1), out, finished, cache))
    return out


# ---------------------------------------------------------------------------- decoder-only models

def decoder_step(model):
    """The ``step_fn`` of a decoder-only model that follows the KV-cache protocol."""
    def step(params, tokens, positions, key_mask, cache, cache_index, extra):
        logits, cache = model.apply(params, tokens, attention_mask=key_mask, positions=positions,
                                    cache=cache, cache_index=cache_index)
        return last_logits(logits), cache
    return step


def _generate(model, cfg, params, input_ids, attention_mask, rng):
    """One call, traced: prefill the cache with the prompt, then :func:`decode`."""
    batch, prompt_len = input_ids.shape
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    attention_mask = attention_mask.astype(jnp.int32)
    n_fed_back = cfg.max_new_tokens - 1  # the last new token is never run through the model
    cache = model.init_cache(batch, prompt_len + n_fed_back,
                             dtype=getattr(model.config, "dtype", jnp.float32))
    # every slot after the prompt will hold a generated token (padding after EOS included)
    key_mask = jnp.concatenate([attention_mask, jnp.ones((batch, n_fed_back), jnp.int32)], axis=1)
    positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)
    step = decoder_step(model)
    if prompt_len > 1:
        # All but the last prompt token fill the cache; their logits are unused, so XLA drops
        # the [B, T, vocab] head matmul (gigabytes for long prompts and large vocabularies).
        _, cache = model.apply(params, input_ids[:, :-1], attention_mask=key_mask,
                               positions=positions[:, :-1], cache=cache,
                               cache_index=jnp.int32(0))
    logits, cache = step(params, input_ids[:, -1:], positions[:, -1:], key_mask, cache,
                         jnp.int32(prompt_len - 1), None)
    next_position = jnp.sum(attention_mask, axis=1).astype(jnp.int32)
    return decode(step, params, logits, cache, key_mask, next_position, jnp.int32(prompt_len),
                  config=cfg, rng=rng, context=input_ids.astype(jnp.int32),
                  context_mask=attention_mask)


@functools.lru_cache(maxsize=64)
def _jitted(model, cfg):
    return jax.jit(functools.partial(_generate, model, cfg))


def generate(model, params, input_ids, attention_mask=None, *, max_new_tokens, do_sample=None,
             temperature=None, top_k=None, top_p=None, num_beams=None, length_penalty=None,
             early_stopping=None, eos_token_id=None, pad_token_id=None, repetition_penalty=None,
             min_new_tokens=None, min_length=None, no_repeat_ngram_size=None,
             forced_bos_token_id=None, forced_eos_token_id=None, stop_sequences=(),
             stop_strings=(), tokenizer=None, rng=None):
    """New tokens for a batch of LEFT-padded prompts: int32 [B, max_new_tokens], each row padded
    with ``pad_token_id`` after its first ``eos_token_id`` (an int or a list).

    ``model`` is a :class:`redcoast.models.Model` of a decoder that follows the KV-cache
    protocol; ``attention_mask`` [B, T] marks real prompt tokens (see :func:`left_pad`).
    ``eos_token_id`` and ``pad_token_id`` default to the model's, as transformers takes them
    (``generation_config.json``, then config.json or the GGUF file's tokenizer metadata; pad
    falls back to the first EOS); ``eos_token_id=()`` generates without stopping.

    The search options left out (None) are taken, as transformers' ``generate`` takes them, from
    the model's ``generation_config.json`` where it sets them, else from transformers' defaults
    (:data:`SEARCH_DEFAULTS`: greedy, ``top_k`` 50 when sampling); sampling asked for by the file
    alone needs ``rng``.

    - greedy (default); ``do_sample=True`` samples with ``temperature``, ``top_k`` (50; 0 = off)
      and ``top_p`` (1 = off), one random stream per row drawn from ``rng``;
    - ``num_beams > 1``: beam search scored as transformers does (sum of log-probabilities /
      new length ** ``length_penalty``; ``early_stopping`` True, False or "never"); with
      ``do_sample`` the beams are sampled. ``num_beams=1`` is greedy.
    - transformers' processors (greedy, sampling and beam search, where they apply to each
      beam's log-probabilities and history, as in transformers): ``repetition_penalty``,
      ``min_new_tokens`` (EOS forbidden before), ``min_length`` (the same, counting the
      padded prompt too, as transformers does; ``min_new_tokens`` wins where both are set),
      ``no_repeat_ngram_size``, ``forced_bos_token_id`` (when the history is one token),
      ``forced_eos_token_id`` (the last new token); ``stop_sequences`` (lists of token ids,
      not with beams) end a row like EOS does.
    - ``stop_strings`` with a ``tokenizer`` (anything with ``decode(ids)``): each row is cut
      after the first token whose text completes one of them (the rest is ``pad_token_id``),
      on the host, so only when called directly.

    Every prompt needs at least one token (e.g. BOS). Inside a jitted function (a Predictor's
    ``pred_fn``) it is traced into it, with whatever sharding the params and batch have; called
    directly, it is compiled once per model, setting and shape (fixed-width prompts from
    ``left_pad(..., length=L)`` avoid recompiling).
    """
    given = dict(
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
        num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping,
        repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens,
        min_length=min_length, no_repeat_ngram_size=no_repeat_ngram_size,
        forced_bos_token_id=forced_bos_token_id, forced_eos_token_id=forced_eos_token_id)
    cfg = search_config(model, given, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                        pad_token_id=pad_token_id, stop_sequences=stop_sequences, rng=rng,
                        context_width=int(np.shape(input_ids)[-1]) if np.ndim(input_ids) else 0)
    pad = cfg.pad_token_id
    stop_strings = checked_stop_strings(stop_strings)
    if stop_strings and tokenizer is None:
        raise ConfigError("stop_strings needs tokenizer=... (what turns the new tokens into text, "
                          "e.g. the tokenizer from_gguf returns).")
    if stop_strings and isinstance(input_ids, jax.core.Tracer):
        raise ConfigError("stop_strings are matched on the host, so generate cannot apply them "
                          "inside a jitted function (a pred_fn). Fix: call cut_at_stop_strings("
                          "tokens, tokenizer, stop_strings, pad_token_id) on the predictions.")
    if np.ndim(input_ids) != 2 or np.shape(input_ids)[1] == 0:
        raise DataError(f"input_ids has shape {np.shape(input_ids)}; generate expects [batch, "
                        "prompt length >= 1] (use left_pad to batch token lists).")
    if attention_mask is not None:
        if np.shape(attention_mask) != np.shape(input_ids):
            raise DataError(f"attention_mask has shape {np.shape(attention_mask)}, input_ids "
                            f"{np.shape(input_ids)}; they must match.")
        _check_left_padded(attention_mask)
    check_token_ids(input_ids, model)
    tokens = _jitted(model, cfg)(params, jnp.asarray(input_ids), attention_mask, rng)
    if not stop_strings:
        return tokens
    return cut_at_stop_strings(np.asarray(tokens), tokenizer, stop_strings, pad)


def split_completions(tokens, eos_token_id):
    """Each row of ``generate``'s output as a list of its new tokens, up to and including its
    first ``eos_token_id`` (an int or a list; the whole row where none came): what a
    reinforcement-learning step scores and trains on, without the padding after EOS."""
    eos = np.atleast_1d(np.asarray(eos_token_id))
    completions = []
    for row in np.asarray(tokens):
        ends = np.flatnonzero(np.isin(row, eos))
        completions.append(row[:ends[0] + 1 if ends.size else len(row)].tolist())
    return completions


def cut_at_stop_strings(tokens, tokenizer, stop_strings, pad_token_id):
    """``tokens`` [B, N] (numpy) with each row cut after the first token whose text completes one
    of ``stop_strings`` (that token kept, the rest ``pad_token_id``), as transformers'
    ``stop_strings`` end a row."""
    stop_strings = checked_stop_strings(stop_strings)
    tokens = np.array(tokens)
    for row in tokens:
        for k in range(1, len(row) + 1):
            text = tokenizer.decode([int(t) for t in row[:k]])
            if any(stop in text for stop in stop_strings):
                row[k:] = pad_token_id
                break
    return tokens


def checked_stop_strings(stop_strings):
    """``stop_strings`` as a tuple of non-empty strings (one string is one stop string; None or
    an empty list: none). An empty string is in every text, so it would cut every row after its
    first token; any other item is no text to look for: both refused."""
    if stop_strings is None:
        return ()
    if isinstance(stop_strings, str):
        stop_strings = (stop_strings,)
    if not isinstance(stop_strings, (list, tuple, set, frozenset)):
        raise ConfigError(f"stop_strings={stop_strings!r} is no text to stop at. Fix: give a "
                          "string or a list of strings (e.g. stop_strings=['\\n\\n']).")
    for stop in stop_strings:
        if not isinstance(stop, str):
            raise ConfigError(f"stop_strings holds {stop!r} ({type(stop).__name__}); each stop "
                              "string is text. Fix: pass strings only (token ids go to "
                              "stop_sequences).")
        if not stop:
            raise ConfigError("stop_strings holds an empty string, which every text contains: "
                              "each row would be cut after its first token. Fix: remove it "
                              "(stop_strings=() for none).")
    return tuple(stop_strings)


def check_token_ids(input_ids, model):
    """Prompt tokens and their padding are ids of the model's vocabulary: outside it JAX's
    embedding lookup gives NaN where PyTorch raises, and a NaN under the attention mask still
    reaches every row's output (0 x NaN), so generation is garbage."""
    ids = _values_here(input_ids)
    if ids is None:
        return
    if not np.issubdtype(ids.dtype, np.integer):
        raise DataError(f"input_ids are {ids.dtype}; generate takes integer token ids. Fix: "
                        "tokenize the text (tokenizer.encode(text).ids).")
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if ids.size and (ids.min() < 0 or (vocab_size and ids.max() >= vocab_size)):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise DataError(f"input_ids hold token id {bad}, outside the model's vocabulary (0 to "
                        f"{vocab_size - 1 if vocab_size else '...'}): JAX would embed it as NaN "
                        "and generate garbage, under the attention mask too. Fix: tokenize with "
                        "the model's own tokenizer and pad with one of its ids; a token added to "
                        "the tokenizer needs the embeddings resized.")


def _values_here(x):
    """``x``'s values as numpy, or None where this process cannot read them all without
    communicating: inside a trace, or an array spread over several processes."""
    if isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    return np.asarray(x)


def _check_left_padded(mask):
    """Explain masks that cannot work: right padding, or a prompt without any token."""
    mask = _values_here(mask)
    if mask is None:
        return
    mask = mask != 0
    if mask.size == 0:
        return
    empty = np.flatnonzero(~mask.any(axis=1))
    if empty.size:
        raise DataError(f"prompt(s) {empty.tolist()} have no tokens (attention_mask is all 0). Fix: "
                        "start every prompt with at least one token, e.g. the BOS token.")
    if not mask[:, -1].all():
        raise DataError("attention_mask has padding in its last column: the prompts are padded on "
                        "the right. Fix: pad them on the left (redcoast.models.generate.left_pad), "
                        "so every row's next token goes into the same cache slot.")
