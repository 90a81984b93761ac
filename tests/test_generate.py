"""Generation with a KV cache: greedy, sampling, beam search; cached decoding against full
recomputation, the filters against numpy, and (with PyTorch) tokens against transformers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from redcoast.errors import ConfigError, DataError
from redcoast.models import Model
from redcoast.models.generate import generate, left_pad, top_k_filter, top_p_filter


# ---------------------------------------------------------------------------- a tiny decoder
# It follows the KV-cache protocol of redcoast.models (see the notes in generate.py) with learned
# positions, so generation can be tested before and independently of the Llama family.

@dataclasses.dataclass(frozen=True)
class TinyConfig:
    vocab: int = 40
    width: int = 32
    heads: int = 2
    layers: int = 2
    max_positions: int = 64
    dtype: object = jnp.float32


class TinyLayer(nnx.Module):
    def __init__(self, cfg, *, rngs, param_dtype=jnp.float32):
        self.heads = cfg.heads
        self.qkv = nnx.Linear(cfg.width, 3 * cfg.width, rngs=rngs, param_dtype=param_dtype)
        self.out = nnx.Linear(cfg.width, cfg.width, rngs=rngs, param_dtype=param_dtype)
        self.up = nnx.Linear(cfg.width, 2 * cfg.width, rngs=rngs, param_dtype=param_dtype)
        self.down = nnx.Linear(2 * cfg.width, cfg.width, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x, mask, cache, cache_index):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * self.heads, d // self.heads), 3, axis=2)
        if cache is not None:
            k = jax.lax.dynamic_update_slice(cache["k"], k, (0, cache_index, 0, 0))
            v = jax.lax.dynamic_update_slice(cache["v"], v, (0, cache_index, 0, 0))
            cache = {"k": k, "v": v}
        y = jax.nn.dot_product_attention(q, k, v, mask=mask)
        x = x + self.out(y.reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(x))), cache


class TinyDecoder(nnx.Module):
    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        self.config = config
        self.embed = nnx.Embed(config.vocab, config.width, rngs=rngs, param_dtype=param_dtype)
        self.pos = nnx.Embed(config.max_positions, config.width, rngs=rngs, param_dtype=param_dtype)
        self.layers = nnx.List([TinyLayer(config, rngs=rngs, param_dtype=param_dtype)
                                for _ in range(config.layers)])
        self.head = nnx.Linear(config.width, config.vocab, rngs=rngs, param_dtype=param_dtype)

    def init_cache(self, batch_size, max_length, dtype=jnp.float32):
        c = self.config
        shape = (batch_size, max_length, c.heads, c.width // c.heads)
        return {"layers": {str(i): {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                           for i in range(c.layers)}}

    def __call__(self, input_ids, attention_mask=None, positions=None, cache=None,
                 cache_index=None):
        b, t = input_ids.shape
        if cache is None:
            keys = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
            if positions is None:
                positions = (jnp.broadcast_to(jnp.arange(t), (b, t)) if attention_mask is None else
                             jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0))
            query_slots, start = jnp.arange(t), 0
        else:
            keys, start = attention_mask.astype(bool), cache_index
            query_slots = cache_index + jnp.arange(t)
        key_slots = jnp.arange(keys.shape[1])
        mask = (key_slots[None, :] <= query_slots[:, None])[None, None] & keys[:, None, None, :]
        x = self.embed(input_ids) + self.pos(positions)
        new_cache = {"layers": {}}
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache["layers"][str(i)]
            x, layer_cache = layer(x, mask, layer_cache, start)
            new_cache["layers"][str(i)] = layer_cache
        logits = self.head(x).astype(jnp.float32)
        return logits if cache is None else (logits, new_cache)


@pytest.fixture(scope="module")
def tiny():
    model = Model(TinyDecoder, TinyConfig())
    params = model.init(3)
    # sharper predictions, so greedy choices are far from ties
    params["head"]["kernel"] = params["head"]["kernel"] * 6.0
    return model, params


PROMPTS = [[5, 9, 2, 31, 7], [11, 3], [8, 8, 20, 1]]


def greedy_uncached(model, params, prompts, n_new, eos=(), pad=0):
    """Greedy decoding by recomputing the whole sequence every step (no cache, no padding)."""
    forward = jax.jit(model.apply)
    out = []
    for prompt in prompts:
        seq, new = list(prompt), []
        while len(new) < n_new and not (new and new[-1] in eos):
            new.append(int(jnp.argmax(forward(params, jnp.asarray([seq], jnp.int32))[0, -1])))
            seq.append(new[-1])
        out.append(new + [pad] * (n_new - len(new)))
    return np.array(out)


def test_greedy_cached_matches_recomputation(tiny):
    model, params = tiny
    ids, mask = left_pad(PROMPTS)
    tokens = generate(model, params, ids, mask, max_new_tokens=6)
    assert tokens.dtype == jnp.int32 and tokens.shape == (3, 6)
    np.testing.assert_array_equal(tokens, greedy_uncached(model, params, PROMPTS, 6))


def test_eos_stops_rows_and_pads(tiny):
    model, params = tiny
    ids, mask = left_pad(PROMPTS)
    free = np.asarray(generate(model, params, ids, mask, max_new_tokens=6))
    eos = int(free[0, 2])  # row 0 ends at its third token
    tokens = np.asarray(generate(model, params, ids, mask, max_new_tokens=6, eos_token_id=[eos, 39],
                                 pad_token_id=-1))
    np.testing.assert_array_equal(tokens, greedy_uncached(model, params, PROMPTS, 6, (eos, 39), -1))
    assert list(tokens[0, 3:]) == [-1, -1, -1]


def test_filters_against_numpy():
    logits = np.array([[1.0, 3.0, -2.0, 3.0, 0.5, 2.0], [0.0, -1.0, 4.0, 1.0, 1.0, -3.0]], np.float32)
    for k in (1, 2, 3, 6):
        kth = np.sort(logits, axis=1)[:, -k][:, None]
        expected = np.where(logits < kth, -np.inf, logits)
        np.testing.assert_array_equal(top_k_filter(jnp.asarray(logits), k), expected)
    # nucleus, as transformers defines it: sorted ascending, drop the tokens whose cumulative
    # probability is <= 1 - p, always keep the most likely one (rows without ties)
    logits = np.array([[1.0, 3.0, -2.0, 2.5, 0.5, 2.0], [0.0, -1.0, 4.0, 1.2, 1.0, -3.0]], np.float32)
    for p in (0.05, 0.5, 0.8, 0.95, 0.999):
        expected = logits.copy()
        for r, row in enumerate(logits):
            order = np.argsort(row)
            probs = np.exp(row[order] - row.max())
            drop = np.cumsum(probs / probs.sum()) <= 1 - p
            drop[-1] = False
            expected[r, order[drop]] = -np.inf
        np.testing.assert_array_equal(top_p_filter(jnp.asarray(logits), p), expected)


def test_sampling(tiny):
    model, params = tiny
    ids, mask = left_pad(PROMPTS)
    greedy = generate(model, params, ids, mask, max_new_tokens=8)
    rng = jax.random.key(0)
    top1 = generate(model, params, ids, mask, max_new_tokens=8, do_sample=True, top_k=1, rng=rng,
                    temperature=0.7)
    np.testing.assert_array_equal(top1, greedy)
    tiny_p = generate(model, params, ids, mask, max_new_tokens=8, do_sample=True, top_p=1e-6, rng=rng)
    np.testing.assert_array_equal(tiny_p, greedy)
    kw = dict(max_new_tokens=8, do_sample=True, temperature=3.0)
    a = generate(model, params, ids, mask, rng=jax.random.key(1), **kw)
    b = generate(model, params, ids, mask, rng=jax.random.key(1), **kw)
    c = generate(model, params, ids, mask, rng=jax.random.key(2), **kw)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # a row's stream depends on its index, not on the rest of the batch
    first = generate(model, params, ids[:1], mask[:1], rng=jax.random.key(1), **kw)
    np.testing.assert_array_equal(first[0], a[0])


def test_one_beam_is_greedy(tiny):
    model, params = tiny
    ids, mask = left_pad(PROMPTS)
    np.testing.assert_array_equal(generate(model, params, ids, mask, max_new_tokens=5, num_beams=1),
                                  generate(model, params, ids, mask, max_new_tokens=5))


def beam_reference(model, params, prompt, n_beams, n_new, eos, length_penalty, early_stopping):
    """Beam search for one prompt, written plainly (lists, no cache, whole sequences recomputed),
    with transformers' rules: the best 2 * n_beams continuations; those of the top n_beams that
    end are finished (score / new length ** length_penalty), the best others run on."""
    width = len(prompt) + n_new
    forward = jax.jit(model.apply)

    def next_logp(seqs):
        ids, mask = left_pad([prompt + s for s in seqs], length=width)
        return np.asarray(jax.nn.log_softmax(forward(params, ids, mask)[:, -1]), np.float64)

    running, finished, open_ = [(0.0, [])], [], True
    for step in range(n_new):
        logp = next_logp([t for _, t in running])
        cands = sorted(((s + logp[b, v], t + [v]) for b, (s, t) in enumerate(running)
                        for v in range(logp.shape[1])), key=lambda c: -c[0])[:2 * n_beams]
        ends = [t[-1] in eos or step == n_new - 1 for _, t in cands]
        full = early_stopping is True and len(finished) == n_beams
        if open_ and not full:
            finished += [(s / (step + 1) ** length_penalty, t)
                         for (s, t), e in zip(cands[:n_beams], ends) if e]
            finished = sorted(finished, key=lambda c: -c[0])[:n_beams]
        running = [c for c, e in zip(cands, ends) if not e][:n_beams]
        if not running:  # the last step: every continuation ended
            break
        if len(finished) == n_beams:
            length = n_new if early_stopping == "never" and length_penalty > 0 else step + 1
            open_ = open_ and running[0][0] / length ** length_penalty > finished[-1][0]
        if not open_ or (early_stopping is True and len(finished) == n_beams):
            break
    best = finished[0][1]
    return best + [-1] * (n_new - len(best))


@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.5, "never"), (2.0, True)])
def test_beam_search_against_plain_reference(tiny, length_penalty, early_stopping):
    model, params = tiny
    ids, mask = left_pad(PROMPTS)
    eos = (4, 10)
    tokens = generate(model, params, ids, mask, max_new_tokens=6, num_beams=3, eos_token_id=eos,
                      pad_token_id=-1, length_penalty=length_penalty, early_stopping=early_stopping)
    expected = [beam_reference(model, params, p, 3, 6, eos, length_penalty, early_stopping)
                for p in PROMPTS]
    np.testing.assert_array_equal(tokens, expected)


def test_errors(tiny):
    model, params = tiny
    ids, mask = left_pad(PROMPTS)
    with pytest.raises(ConfigError, match="rng"):
        generate(model, params, ids, mask, max_new_tokens=2, do_sample=True)
    with pytest.raises(ConfigError, match="top_p"):
        generate(model, params, ids, mask, max_new_tokens=2, top_p=0.0)
    with pytest.raises(DataError, match="left"):
        generate(model, params, ids[:, ::-1], mask[:, ::-1], max_new_tokens=2)
    with pytest.raises(DataError, match="length"):
        left_pad([[1, 2, 3]], length=2)
