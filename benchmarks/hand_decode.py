"""A Llama decoder's generation written by hand in plain JAX: the floor redcoast's ``generate``
is measured against (benchmarks/generate.py).

Nothing here comes from redcoast: the forward pass (embedding, RMSNorm, rotary positions,
grouped-query attention over a KV cache, SwiGLU, a tied or separate head) is written from the
Llama paper's equations over redcoast's parameter tree (Hugging Face names), and the loops are
the plainest a user would write: the prompt prefilled in one call, then one token per step in a
``lax.fori_loop`` for a fixed number of tokens (no EOS, no logits processors), greedy or beam
search (each step the best ``num_beams`` of every prompt's ``num_beams x vocab`` continuations,
the KV cache rows reordered to follow them; with no EOS every hypothesis has the same length, so
the best running beam at the end is the answer).

Only the default rotary table (no scaling) and full attention (no sliding window) are written:
the benchmark's model has neither.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _rms_norm(x, scale, eps):
    h = x.astype(jnp.float32)
    h = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return scale * h


def _rotate(x, positions, theta):
    """Rotary positions, the halves of each head paired: x [B, T, H, D], positions [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    rotated = jnp.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * jnp.cos(angles) + rotated * jnp.sin(angles)


def _layer(config, p, x, positions, key_mask, k_cache, v_cache, start):
    """One decoder layer on tokens x [B, T, C] written at cache slots start..start+T-1."""
    c = config
    b, t, _ = x.shape
    heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    a = p["self_attn"]
    h = _rms_norm(x, p["input_layernorm"]["scale"], c.rms_norm_eps)
    q = (h @ a["q_proj"]["kernel"]).reshape(b, t, heads, d)
    k = (h @ a["k_proj"]["kernel"]).reshape(b, t, kv_heads, d)
    v = (h @ a["v_proj"]["kernel"]).reshape(b, t, kv_heads, d)
    q, k = _rotate(q, positions, c.rope_theta), _rotate(k, positions, c.rope_theta)
    k_cache = lax.dynamic_update_slice(k_cache, k, (0, start, 0, 0))
    v_cache = lax.dynamic_update_slice(v_cache, v, (0, start, 0, 0))
    slots = jnp.arange(k_cache.shape[1])
    visible = (slots[None, :] <= (start + jnp.arange(t))[:, None])[None] & key_mask[:, None, :]
    group = heads // kv_heads
    q = q.reshape(b, t, kv_heads, group, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_cache) * d ** -0.5
    scores = jnp.where(visible[:, None, None], scores, -1e30)
    y = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(scores, axis=-1), v_cache)
    x = x + y.reshape(b, t, heads * d) @ a["o_proj"]["kernel"]
    m = p["mlp"]
    h = _rms_norm(x, p["post_attention_layernorm"]["scale"], c.rms_norm_eps)
    x = x + (jax.nn.silu(h @ m["gate_proj"]["kernel"]) * (h @ m["up_proj"]["kernel"])) @ \
        m["down_proj"]["kernel"]
    return x, k_cache, v_cache


def _forward(config, params, ids, positions, key_mask, caches, start):
    """Next-token logits [B, V] of the last of ``ids`` [B, T], and the caches with them written."""
    x = params["embed_tokens"]["embedding"][ids]
    new_caches = []
    for i in range(config.num_hidden_layers):
        x, k, v = _layer(config, params["layers"][str(i)], x, positions, key_mask, *caches[i],
                         start)
        new_caches.append((k, v))
    x = _rms_norm(x[:, -1], params["norm"]["scale"], config.rms_norm_eps)
    head = (params["embed_tokens"]["embedding"].T if config.tie_word_embeddings
            else params["lm_head"]["kernel"])
    return x @ head, new_caches


def _prefill(config, params, ids, mask, n_new):
    b, t = ids.shape
    shape = (b, t + n_new - 1, config.num_key_value_heads, config.head_dim)
    caches = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(config.num_hidden_layers)]
    key_mask = jnp.concatenate([mask, jnp.ones((b, n_new - 1), mask.dtype)], axis=1).astype(bool)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    logits, caches = _forward(config, params, ids, positions, key_mask, caches, 0)
    return logits, caches, key_mask, jnp.sum(mask, axis=1)


@functools.partial(jax.jit, static_argnums=(0, 4))
def greedy(config, params, ids, mask, n_new):
    """int32 [B, n_new]: the argmax token at every step."""
    b, t = ids.shape
    logits, caches, key_mask, next_position = _prefill(config, params, ids, mask, n_new)
    out = jnp.zeros((b, n_new), jnp.int32).at[:, 0].set(jnp.argmax(logits, -1))

    def step(i, carry):
        out, caches = carry
        previous = lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
        logits, caches = _forward(config, params, previous, (next_position + i - 1)[:, None],
                                  key_mask, caches, t + i - 1)
        return out.at[:, i].set(jnp.argmax(logits, -1).astype(jnp.int32)), caches

    return lax.fori_loop(1, n_new, step, (out, caches))[0]


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def beam(config, params, ids, mask, n_new, n_beams):
    """int32 [B, n_new]: the best of ``n_beams`` hypotheses by summed log-probability."""
    b, t = ids.shape
    k = n_beams
    ids, mask = jnp.repeat(ids, k, axis=0), jnp.repeat(mask, k, axis=0)
    logits, caches, key_mask, next_position = _prefill(config, params, ids, mask, n_new)
    vocab = logits.shape[-1]
    # only each prompt's first copy is live at the start, so the copies do not pick alike
    scores = jnp.tile(jnp.where(jnp.arange(k) == 0, 0.0, -1e30), (b, 1))
    seqs = jnp.zeros((b, k, n_new), jnp.int32)

    def choose(i, logits, scores, seqs, caches):
        total = scores[..., None] + jax.nn.log_softmax(logits).reshape(b, k, vocab)
        scores, flat = lax.top_k(total.reshape(b, k * vocab), k)
        source, token = flat // vocab, (flat % vocab).astype(jnp.int32)
        follow = jax.vmap(lambda rows, index: rows[index])
        seqs = follow(seqs, source).at[:, :, i].set(token)
        rows = (source + jnp.arange(b)[:, None] * k).reshape(-1)
        caches = [(kc[rows], vc[rows]) for kc, vc in caches]
        return scores, seqs, caches

    scores, seqs, caches = choose(0, logits, scores, seqs, caches)

    def step(i, carry):
        scores, seqs, caches = carry
        tokens = lax.dynamic_slice_in_dim(seqs, i - 1, 1, axis=2).reshape(b * k, 1)
        logits, caches = _forward(config, params, tokens, (next_position + i - 1)[:, None],
                                  key_mask, caches, t + i - 1)
        return choose(i, logits, scores, seqs, caches)

    return lax.fori_loop(1, n_new, step, (scores, seqs, caches))[1][:, 0]


@functools.partial(jax.jit, static_argnums=(0, 2))
def weights_alone(config, params, n_tokens):
    """The floor under any decode loop on this backend: ``n_tokens`` steps of nothing but the
    matrix-vector products a token needs (every projection of every layer, then the head), each
    reading its weight once, in the same sequence (each product waits for the one before, as
    in the model). No attention, norms or cache: what is left is streaming the weights through
    the backend's matrix-vector product."""
    head = (params["embed_tokens"]["embedding"].T if config.tie_word_embeddings
            else params["lm_head"]["kernel"])
    repeat = config.num_attention_heads // config.num_key_value_heads

    def step(_, x):
        for i in range(config.num_hidden_layers):
            a, m = params["layers"][str(i)]["self_attn"], params["layers"][str(i)]["mlp"]
            k, v = x @ a["k_proj"]["kernel"], x @ a["v_proj"]["kernel"]
            x = x + (x @ a["q_proj"]["kernel"] + jnp.tile(k + v, repeat)) @ a["o_proj"]["kernel"]
            x = x + (jax.nn.silu(x @ m["gate_proj"]["kernel"]) * (x @ m["up_proj"]["kernel"])) @ \
                m["down_proj"]["kernel"]
            x = x * 1e-3  # keeps the values finite over many layers; one multiply
        token = jnp.argmax(x @ head, axis=-1)
        return params["embed_tokens"]["embedding"][token]

    x = jnp.ones((1, config.hidden_size), params["embed_tokens"]["embedding"].dtype)
    return lax.fori_loop(0, n_tokens, step, x)
