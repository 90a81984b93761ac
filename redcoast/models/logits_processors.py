"""transformers' basic logits processors, in fixed shapes, for greedy decoding, sampling and
beam search (there on each beam's log-probabilities and own history, as in transformers).

Each step of the decoding loop sees the tokens so far as one int32 buffer ``ids`` [B, C + N]:
the ``C`` context tokens (the left-padded prompt of a decoder, the start token of an
encoder-decoder's decoder) followed by the ``N`` new ones, with ``valid`` marking the real
tokens (the prompt's padding and the new slots not yet written are not). The processors run in
transformers' order (repetition penalty, no-repeat n-grams, min_new_tokens, forced BOS, forced
EOS) before temperature, top-k and top-p. Unlike transformers, the prompt's padding is not part
of the history (transformers penalises and counts n-grams of pad tokens too).
"""

import jax.numpy as jnp
from jax import lax


def any_active(cfg):
    """Whether ``cfg`` asks for any processor here (else the loop skips the history)."""
    return (cfg.repetition_penalty != 1.0 or cfg.no_repeat_ngram_size > 0
            or cfg.min_new_tokens > 0 or cfg.forced_bos_token_id is not None
            or bool(cfg.forced_eos_token_id))


def history(context, context_mask, new, i):
    """``(ids, valid)`` [R, C + N]: each row's context then its new tokens, of which the first
    ``i`` are written (``new`` [R, N]; ``context_mask`` bool [R, C])."""
    ids = jnp.concatenate([context, new], axis=1)
    written = jnp.broadcast_to(jnp.arange(new.shape[1]) < i, new.shape)
    return ids, jnp.concatenate([context_mask, written], axis=1)


def seen_tokens(ids, valid, vocab):
    """bool [B, V]: which tokens occur among the valid ``ids`` of each row."""
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], vocab), bool).at[rows, ids].max(valid)


def repetition_penalty(logits, ids, valid, penalty):
    """CTRL's penalty as transformers applies it: every token already in the row has its logit
    divided by ``penalty`` where positive, multiplied where negative."""
    penalised = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen_tokens(ids, valid, logits.shape[-1]), penalised, logits)


def banned_by_ngrams(ids, valid, end, n, vocab):
    """bool [B, V]: the tokens that would repeat an n-gram of the row, given its valid tokens
    up to (not including) position ``end``: those that followed an earlier occurrence of the
    last ``n - 1`` tokens."""
    width = ids.shape[1]
    n_windows = width - n + 1
    if n_windows <= 0:
        return jnp.zeros((ids.shape[0], vocab), bool)
    windows = jnp.stack([ids[:, k:k + n_windows] for k in range(n)], axis=-1)       # [B, W, n]
    whole = jnp.stack([valid[:, k:k + n_windows] for k in range(n)], axis=-1).all(-1)
    whole = whole & (jnp.arange(n_windows) + n <= end)[None]                        # before end
    if n == 1:  # every token seen bans itself
        matches = whole
    else:
        start = jnp.maximum(end - (n - 1), 0)
        last = lax.dynamic_slice_in_dim(ids, start, n - 1, axis=1)                  # [B, n-1]
        last_valid = lax.dynamic_slice_in_dim(valid, start, n - 1, axis=1).all(-1) & (end >= n - 1)
        matches = (windows[..., :-1] == last[:, None, :]).all(-1) & whole & last_valid[:, None]
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], vocab), bool).at[rows, windows[..., -1]].max(matches)


def token_mask(vocab, token_ids):
    """bool [V]: True at ``token_ids``."""
    return jnp.zeros(vocab, bool).at[jnp.asarray(token_ids)].set(True)


def only(logits, token_ids):
    """Logits that force one of ``token_ids``: 0 there, -inf everywhere else."""
    keep = token_mask(logits.shape[-1], token_ids)
    return jnp.broadcast_to(jnp.where(keep, 0.0, -jnp.inf).astype(logits.dtype), logits.shape)


def process(logits, cfg, i, ids, valid, context_width):
    """Logits [B, V] (float32) for new token ``i`` after transformers' processors: ``ids`` and
    ``valid`` [B, C + N] hold the context and the new tokens written so far."""
    end = context_width + i  # the history's length, padding included (transformers' cur_len)
    if cfg.repetition_penalty != 1.0:
        logits = repetition_penalty(logits, ids, valid, cfg.repetition_penalty)
    if cfg.no_repeat_ngram_size > 0:
        banned = banned_by_ngrams(ids, valid, end, cfg.no_repeat_ngram_size, logits.shape[-1])
        logits = jnp.where(banned, -jnp.inf, logits)
    if cfg.min_new_tokens > 0 and cfg.eos_token_id:
        eos = token_mask(logits.shape[-1], cfg.eos_token_id)
        logits = jnp.where(eos & (i < cfg.min_new_tokens), -jnp.inf, logits)
    if cfg.forced_bos_token_id is not None:
        logits = jnp.where(end == 1, only(logits, [cfg.forced_bos_token_id]), logits)
    if cfg.forced_eos_token_id:
        logits = jnp.where(i == cfg.max_new_tokens - 1, only(logits, cfg.forced_eos_token_id),
                           logits)
    return logits


def ends_with_a_stop_sequence(out, i, stop_sequences):
    """bool [B]: whether the new tokens up to ``i`` (included) end with one of the sequences."""
    hit = jnp.zeros(out.shape[0], bool)
    for seq in stop_sequences:
        k = len(seq)
        if k > out.shape[1]:  # longer than all the new tokens: never met
            continue
        tail = lax.dynamic_slice_in_dim(out, jnp.maximum(i - k + 1, 0), k, axis=1)
        hit = hit | ((tail == jnp.asarray(seq, jnp.int32)).all(-1) & (i + 1 >= k))
    return hit
