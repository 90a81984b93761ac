"""Beam search with fixed shapes, scored and stopped exactly as transformers' beam search.

Per prompt, ``num_beams`` running hypotheses and ``num_beams`` finished ones are kept. Each
step looks at the best ``max(2, 1 + n_eos) * num_beams`` continuations of all running beams
(so enough of them do not end in EOS to continue); the best that do not finish continue, and
those among the top ``num_beams`` that finish (EOS, or the last allowed token) compete for the
finished slots with score = sum of log-probabilities / new length ** length_penalty.
A prompt stops gaining hypotheses when its best running beam can no longer beat its worst
finished one (``early_stopping=False``: judged at the current length; ``"never"``: at the
longest length when length_penalty > 0; ``True``: as soon as ``num_beams`` hypotheses are done).

transformers' logits processors (repetition penalty, no-repeat n-grams, min length, forced
BOS/EOS) apply as there: to each beam's log-probabilities (after log-softmax, before the beam's
score is added), looking back on that beam's own history (the context, then its new tokens).
"""

import jax
import jax.numpy as jnp
from jax import lax

from . import logits_processors as processors
from .search_parts import NEG, is_eos, last_logits, row_keys, warp


def _expand(tree, n_beams):
    """Every leaf's rows repeated ``n_beams`` times: [B, ...] -> [B * n_beams, ...]."""
    return jax.tree_util.tree_map(lambda x: jnp.repeat(x, n_beams, axis=0), tree)


def _gather_beams(x, index):
    """``x[b, index[b, j]]`` for x [B, K, ...] and index [B, J] (one gather per prompt: rows of
    different prompts never mix, so a batch split over devices stays local)."""
    return jax.vmap(lambda xb, ib: xb[ib])(x, index)


def _reorder(cache, source_beam, n_beams):
    """Cache rows [B * K, ...] rearranged so beam j of prompt b continues its ``source_beam``."""
    def one(x):
        rows = x.reshape((-1, n_beams) + x.shape[1:])
        return _gather_beams(rows, source_beam).reshape(x.shape)
    return jax.tree_util.tree_map(one, cache)


def beam_search(step_fn, params, logits, cache, key_mask, positions, cache_index, extra, *,
                config, rng, context, context_mask):
    """The best finished hypothesis per prompt: int32 [B, max_new_tokens] (see generate.decode;
    ``context`` [B, C] and ``context_mask`` (bool) are the tokens before the new ones)."""
    cfg = config
    batch, vocab = logits.shape[0], logits.shape[-1]
    n_beams, n_new = cfg.num_beams, cfg.max_new_tokens
    n_cand = max(2, 1 + len(cfg.eos_token_id)) * n_beams
    lp = cfg.length_penalty
    keys = row_keys(rng, batch) if cfg.do_sample else None
    cache, key_mask, positions, extra = _expand((cache, key_mask, positions, extra), n_beams)
    logits, context, context_mask = _expand((logits, context, context_mask), n_beams)

    def advance(s, logits):
        """Choose the i-th new token of every hypothesis; update running and finished beams."""
        i = s["i"]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        if processors.any_active(cfg):
            ids, valid = processors.history(context, context_mask,
                                            s["run_seqs"].reshape(batch * n_beams, n_new), i)
            logp = processors.process(logp, cfg, i, ids, valid, context.shape[1])
        if cfg.do_sample:
            logp = warp(logp, cfg)
        total = (logp.reshape(batch, n_beams, vocab) + s["run_scores"][..., None])
        total = total.reshape(batch, n_beams * vocab)
        if cfg.do_sample:
            # Gumbel top-k: n_cand draws without replacement from softmax(total)
            step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)
            gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (n_beams * vocab,)))(step_keys)
            flat = lax.top_k(total + gumbel, n_cand)[1]
            scores = jnp.take_along_axis(total, flat, axis=1)
        else:
            scores, flat = lax.top_k(total, n_cand)
        beam, token = flat // vocab, (flat % vocab).astype(jnp.int32)
        seqs = _gather_beams(s["run_seqs"], beam)
        seqs = jnp.where(jnp.arange(n_new) == i, token[..., None], seqs)
        ends = is_eos(token, cfg) | (i + 1 >= n_new)

        # running: the best continuations that do not end
        run_scores = scores + ends.astype(jnp.float32) * NEG
        pick = lax.top_k(run_scores, n_beams)[1]
        source_beam = jnp.take_along_axis(beam, pick, axis=1)

        # finished: the top n_beams continuations that end, if they beat the finished ones
        just_done = ends & (jnp.arange(n_cand) < n_beams)
        done_scores = scores / ((i + 1).astype(jnp.float32) ** lp)
        if cfg.early_stopping is True:
            full = jnp.all(s["fin_done"], axis=1, keepdims=True)
            done_scores = done_scores + full.astype(jnp.float32) * NEG
        done_scores = done_scores + (~s["open"]).astype(jnp.float32)[:, None] * NEG
        done_scores = done_scores + (~just_done).astype(jnp.float32) * NEG
        all_scores = jnp.concatenate([s["fin_scores"], done_scores], axis=1)
        keep = lax.top_k(all_scores, n_beams)[1]
        fin_seqs = _gather_beams(jnp.concatenate([s["fin_seqs"], seqs], axis=1), keep)
        fin_done = jnp.take_along_axis(jnp.concatenate([s["fin_done"], just_done], axis=1), keep, 1)
        fin_scores = jnp.take_along_axis(all_scores, keep, axis=1)

        run_scores = jnp.take_along_axis(run_scores, pick, axis=1)
        i = i + 1
        open_ = s["open"] & _may_improve(run_scores, fin_scores, fin_done, i, cfg)
        more = jnp.any(open_) & ~jnp.all(ends)
        if cfg.early_stopping is True:
            more = more & ~jnp.all(fin_done)
        return dict(i=i, run_seqs=_gather_beams(seqs, pick), run_scores=run_scores,
                    fin_seqs=fin_seqs, fin_scores=fin_scores, fin_done=fin_done, open=open_,
                    more=more & (i < n_new), cache=_reorder(s["cache"], source_beam, n_beams))

    start = dict(
        i=jnp.int32(0),
        run_seqs=jnp.full((batch, n_beams, n_new), cfg.pad_token_id, jnp.int32),
        # only the first copy of each prompt starts live, so the first step does not pick the
        # same token from every copy
        run_scores=jnp.tile(jnp.where(jnp.arange(n_beams) == 0, 0.0, NEG), (batch, 1)),
        fin_seqs=jnp.full((batch, n_beams, n_new), cfg.pad_token_id, jnp.int32),
        fin_scores=jnp.full((batch, n_beams), NEG, jnp.float32),
        fin_done=jnp.zeros((batch, n_beams), bool),
        open=jnp.ones((batch,), bool),
        more=jnp.bool_(True),
        cache=cache)
    state = advance(start, logits)

    def body(s):
        j = s["i"] - 1  # the slot of the token chosen last
        tokens = s["run_seqs"][:, :, j].reshape(-1, 1)
        logits, cache = step_fn(params, tokens, (positions + j)[:, None], key_mask, s["cache"],
                                cache_index + j, extra)
        return advance(dict(s, cache=cache), last_logits(logits))

    state = lax.while_loop(lambda s: s["more"], body, state)
    return state["fin_seqs"][:, 0]


def _may_improve(run_scores, fin_scores, fin_done, length, cfg):
    """Whether a prompt's best running beam could still beat its worst finished hypothesis."""
    if cfg.early_stopping == "never" and cfg.length_penalty > 0:
        length = cfg.max_new_tokens  # a longer hypothesis scores better: judge at the longest
    best = run_scores[:, :1] / (jnp.asarray(length).astype(jnp.float32) ** cfg.length_penalty)
    worst = jnp.where(fin_done, jnp.min(fin_scores, axis=1, keepdims=True), NEG)
    return jnp.any(best > worst, axis=1)
