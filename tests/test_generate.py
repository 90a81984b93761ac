"""Generation with a KV cache: greedy and beam search against transformers and against plain
recomputation without a cache, sampling, the top-k/top-p filters against numpy, sharded
parameters and generation inside a Predictor's pred_fn.

Every call shares one tiny Llama and a few settings, so each setting compiles once."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import redcoast
from redcoast.errors import ConfigError, DataError
from redcoast.models import Model, llama
from redcoast.models.generate import generate, left_pad
from redcoast.models.search_parts import top_k_filter, top_p_filter

HAS_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
needs_torch = pytest.mark.skipif(
    not HAS_TORCH, reason="test-only reference: pip install torch==2.13.0 transformers")

PROMPTS = [[1, 17, 45, 9, 80, 33, 5], [1, 60, 72], [1, 88, 21, 54, 3]]
PAD = 95  # not 0: transformers' beam search fills with EOS when pad_token_id is 0
N_NEW = 8
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            initializer_range=0.15,  # sharper next-token distributions than 0.02: no near-ties
            bos_token_id=1, eos_token_id=2)
IDS, MASK = left_pad(PROMPTS, PAD)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model or None, redcoast model, params): a random LlamaForCausalLM saved by
    transformers and read by redcoast.models.from_pretrained, or without PyTorch redcoast's own."""
    if not HAS_TORCH:
        model = Model(llama.LlamaForCausalLM, llama.LlamaConfig(**TINY))
        return None, model, model.init(0)
    import torch
    import transformers

    from redcoast.models import from_pretrained

    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    folder = tmp_path_factory.mktemp("llama")
    reference.save_pretrained(folder)
    model, params = from_pretrained(folder)
    return reference, model, params


@pytest.fixture(scope="module")
def free_greedy(tiny):
    """Greedy tokens without EOS (compiled once, shared)."""
    _, model, params = tiny
    return np.asarray(generate(model, params, IDS, MASK, max_new_tokens=N_NEW, eos_token_id=()))


def eos_of(free_greedy):
    return int(free_greedy[1, 3])  # the second prompt then stops after 4 tokens


def hf_generate(reference, **kw):
    import torch

    with torch.no_grad():
        out = reference.generate(input_ids=torch.tensor(IDS, dtype=torch.long),
                                 attention_mask=torch.tensor(MASK, dtype=torch.long),
                                 max_new_tokens=N_NEW, pad_token_id=PAD, do_sample=False, **kw)
    new = out[:, IDS.shape[1]:].numpy()  # cut at the longest hypothesis: pad to N_NEW
    return np.pad(new, ((0, 0), (0, N_NEW - new.shape[1])), constant_values=PAD)


class Recompute:
    """Next-token log-probabilities of whole sequences, recomputed without a cache (one fixed
    shape: 3 rows left-padded to the longest prompt + N_NEW)."""

    def __init__(self, model, params):
        self.params = params
        self.forward = jax.jit(model.apply)

    def __call__(self, seqs):
        rows = list(seqs) + [seqs[0]] * (3 - len(seqs))
        ids, mask = left_pad(rows, PAD, length=IDS.shape[1] + N_NEW)
        logits = self.forward(self.params, ids, mask)[:, -1]
        return np.asarray(jax.nn.log_softmax(logits), np.float64)[:len(seqs)]


def greedy_reference(recompute, eos=()):
    seqs, new = [list(p) for p in PROMPTS], [[] for _ in PROMPTS]
    for _ in range(N_NEW):
        nxt = recompute(seqs).argmax(axis=1)
        for row, token in enumerate(nxt):
            if not (new[row] and new[row][-1] in eos):
                new[row].append(int(token))
                seqs[row].append(int(token))
    return np.array([n + [PAD] * (N_NEW - len(n)) for n in new])


def test_greedy_cached_equals_recomputation(tiny, free_greedy):
    _, model, params = tiny
    recompute = Recompute(model, params)
    assert free_greedy.dtype == np.int32 and free_greedy.shape == (3, N_NEW)
    np.testing.assert_array_equal(free_greedy, greedy_reference(recompute))
    eos = eos_of(free_greedy)
    tokens = np.asarray(generate(model, params, IDS, MASK, max_new_tokens=N_NEW,
                                 eos_token_id=[eos, 94], pad_token_id=PAD))
    np.testing.assert_array_equal(tokens, greedy_reference(recompute, (eos, 94)))
    assert list(tokens[1, 4:]) == [PAD] * 4


@needs_torch
def test_greedy_equals_transformers(tiny, free_greedy):
    reference, model, params = tiny
    eos = eos_of(free_greedy)
    expected = hf_generate(reference, eos_token_id=[eos, 94])
    tokens = generate(model, params, IDS, MASK, max_new_tokens=N_NEW, eos_token_id=[eos, 94],
                      pad_token_id=PAD)
    assert (expected == PAD).any()  # a row stopped early
    np.testing.assert_array_equal(tokens, expected)


def test_one_beam_is_greedy(tiny, free_greedy):
    _, model, params = tiny
    tokens = generate(model, params, IDS, MASK, max_new_tokens=N_NEW, num_beams=1, eos_token_id=())
    np.testing.assert_array_equal(tokens, free_greedy)


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


def test_sampling(tiny, free_greedy):
    _, model, params = tiny
    top1 = generate(model, params, IDS, MASK, max_new_tokens=N_NEW, do_sample=True, top_k=1,
                    temperature=0.7, rng=jax.random.key(0), eos_token_id=())
    np.testing.assert_array_equal(top1, free_greedy)
    kw = dict(max_new_tokens=N_NEW, do_sample=True, temperature=2.0, top_p=0.95, eos_token_id=())
    a = generate(model, params, IDS, MASK, rng=jax.random.key(1), **kw)
    b = generate(model, params, IDS, MASK, rng=jax.random.key(1), **kw)
    c = generate(model, params, IDS, MASK, rng=jax.random.key(2), **kw)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c) and not np.array_equal(a, free_greedy)


def beam_reference(recompute, prompt, n_beams, eos, length_penalty, early_stopping):
    """Beam search for one prompt, written plainly (lists, no cache, whole sequences recomputed)
    with transformers' rules: the best 2 * n_beams continuations; those of the top n_beams that
    end are finished (score / new length ** length_penalty), the best others run on."""
    running, finished, open_ = [(0.0, [])], [], True
    for step in range(N_NEW):
        logp = recompute([prompt + t for _, t in running])
        cands = sorted(((s + logp[b, v], t + [v]) for b, (s, t) in enumerate(running)
                        for v in range(logp.shape[1])), key=lambda c: -c[0])[:2 * n_beams]
        ends = [t[-1] in eos or step == N_NEW - 1 for _, t in cands]
        if open_ and not (early_stopping is True and len(finished) == n_beams):
            finished += [(s / (step + 1) ** length_penalty, t)
                         for (s, t), e in zip(cands[:n_beams], ends) if e]
            finished = sorted(finished, key=lambda c: -c[0])[:n_beams]
        running = [c for c, e in zip(cands, ends) if not e][:n_beams]
        if not running:  # the last step: every continuation ended
            break
        if len(finished) == n_beams:
            length = N_NEW if early_stopping == "never" and length_penalty > 0 else step + 1
            open_ = open_ and running[0][0] / length ** length_penalty > finished[-1][0]
        if not open_ or (early_stopping is True and len(finished) == n_beams):
            break
    best = finished[0][1]
    return best + [PAD] * (N_NEW - len(best))


BEAM_EOS = [15, 6]  # with length_penalty 0.5, hypotheses of 1 and 5 tokens win


def test_beam_search_against_plain_reference(tiny):
    reference, model, params = tiny
    tokens = generate(model, params, IDS, MASK, max_new_tokens=N_NEW, num_beams=3,
                      eos_token_id=BEAM_EOS, pad_token_id=PAD, length_penalty=2.0,
                      early_stopping=True)
    recompute = Recompute(model, params)
    expected = [beam_reference(recompute, p, 3, BEAM_EOS, 2.0, True) for p in PROMPTS]
    np.testing.assert_array_equal(tokens, expected)
    if reference is not None:
        np.testing.assert_array_equal(tokens, hf_generate(
            reference, num_beams=3, eos_token_id=BEAM_EOS, length_penalty=2.0,
            early_stopping=True))


@needs_torch
@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.5, False),
                                                           (0.5, "never")])
def test_beam_search_equals_transformers(tiny, length_penalty, early_stopping):
    reference, model, params = tiny
    expected = hf_generate(reference, num_beams=3, eos_token_id=BEAM_EOS,
                           length_penalty=length_penalty, early_stopping=early_stopping)
    tokens = generate(model, params, IDS, MASK, max_new_tokens=N_NEW, num_beams=3,
                      eos_token_id=BEAM_EOS, length_penalty=length_penalty,
                      early_stopping=early_stopping, pad_token_id=PAD)
    np.testing.assert_array_equal(tokens, expected)


def test_beam_sampling(tiny):
    _, model, params = tiny
    kw = dict(max_new_tokens=N_NEW, num_beams=3, eos_token_id=BEAM_EOS, pad_token_id=PAD)
    # near temperature 0 the Gumbel noise cannot reorder candidates: plain beam search
    cold = generate(model, params, IDS, MASK, do_sample=True, temperature=1e-6,
                    rng=jax.random.key(0), **kw)
    np.testing.assert_array_equal(cold, generate(model, params, IDS, MASK, **kw))
    a, b, c = (generate(model, params, IDS, MASK, do_sample=True, rng=jax.random.key(seed), **kw)
               for seed in (1, 1, 2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.fixture(scope="module")
def deployer():
    return redcoast.Deployer(n_model_shards=2, verbose=False)  # 4 data shards


def test_sharded_params_give_the_same_tokens(tiny, free_greedy, deployer):
    _, model, params = tiny
    plan = deployer.get_sharding_plan(params, traced_fn=model.apply,
                                      example_args=llama.example_inputs(model.config))
    sharded = jax.device_put(params, plan.param_shardings())
    specs = [s.spec for s in jax.tree_util.tree_leaves(plan.param_shardings())]
    assert any("mp" in jax.tree_util.tree_leaves(tuple(spec)) for spec in specs)
    kw = dict(max_new_tokens=N_NEW, eos_token_id=[eos_of(free_greedy), 94], pad_token_id=PAD)
    np.testing.assert_array_equal(generate(model, sharded, IDS, MASK, **kw),
                                  generate(model, params, IDS, MASK, **kw))


def test_beam_search_inside_a_predictor(tiny, deployer):
    _, model, params = tiny
    kw = dict(max_new_tokens=N_NEW, num_beams=3, eos_token_id=BEAM_EOS, pad_token_id=PAD)

    def collate_fn(prompts):
        ids, mask = left_pad(prompts, PAD, length=IDS.shape[1])
        return {"ids": ids, "mask": mask}

    def pred_fn(rng, params, batch):
        return generate(model, params, batch["ids"], batch["mask"], **kw)

    prompts = PROMPTS + [[1, 40], [1, 2, 3, 4, 5, 6, 7]]  # 5 prompts: two batches of 4
    outputs = redcoast.Predictor(deployer, collate_fn, pred_fn).predict(prompts, 1, params)
    # the same tokens as direct calls (of the same shape as the other tests': compiled already)
    ids, mask = left_pad(prompts[3:] + prompts[:1], PAD, length=IDS.shape[1])
    expected = np.concatenate([generate(model, params, IDS, MASK, **kw),
                               generate(model, params, ids, mask, **kw)[:2]])
    np.testing.assert_array_equal(np.stack(outputs), expected)


def test_more_model_shards_than_kv_heads_inside_a_predictor(tiny, free_greedy):
    # 2 KV heads on 4 model shards: traced for 4 shards, attention repeats K/V per query head,
    # so the plan splits the query heads (not the whole attention replicated) and keeps each KV
    # head on the 2 shards of its query heads; the cached decoding inside the Predictor's
    # pred_fn takes the same path
    _, model, params = tiny
    four = redcoast.Deployer(n_model_shards=4, verbose=False)
    plan = four.get_sharding_plan(params, traced_fn=model.apply,
                                  example_args=llama.example_inputs(model.config))
    specs = {pl.path[-2]: tuple(pl.spec) for pl in plan.compute_placements if pl.path[-1] == "kernel"}
    assert "mp" in specs["q_proj"] and "mp" in specs["o_proj"]
    assert "mp:2" in specs["k_proj"] and "mp:2" in specs["v_proj"]

    def collate_fn(prompts):
        ids, mask = left_pad(prompts, PAD, length=IDS.shape[1])
        return {"ids": ids, "mask": mask}

    def pred_fn(rng, params, batch):
        return generate(model, params, batch["ids"], batch["mask"], max_new_tokens=N_NEW,
                        eos_token_id=())

    sharded = jax.device_put(params, plan.param_shardings())
    outputs = redcoast.Predictor(four, collate_fn, pred_fn).predict(PROMPTS, 2, sharded)
    np.testing.assert_array_equal(np.stack(outputs), free_greedy)


def test_errors(tiny):
    _, model, params = tiny
    with pytest.raises(ConfigError, match="rng"):
        generate(model, params, IDS, MASK, max_new_tokens=2, do_sample=True)
    with pytest.raises(ConfigError, match="top_p"):
        generate(model, params, IDS, MASK, max_new_tokens=2, top_p=0.0)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        generate(model, params, IDS, MASK, max_new_tokens=0)
    with pytest.raises(DataError, match="left"):
        generate(model, params, IDS[:, ::-1], MASK[:, ::-1], max_new_tokens=2)
    with pytest.raises(DataError, match=r"prompt\(s\) \[1\] have no tokens"):
        generate(model, params, IDS, MASK * np.array([[1], [0], [1]]), max_new_tokens=2)
    with pytest.raises(DataError, match="prompt length >= 1"):
        generate(model, params, IDS[:, :0], max_new_tokens=2)
    with pytest.raises(DataError, match="integer token ids"):
        generate(model, params, IDS.astype(np.float32), MASK, max_new_tokens=2)
    # past the embeddings, even as padding under a zero mask: its NaN embedding reaches every
    # position through attention (weight 0 x NaN), so generation would be garbage
    with pytest.raises(DataError, match=r"token id 96, outside the model's vocabulary"):
        generate(model, params, np.where(MASK == 1, IDS, 96), MASK, max_new_tokens=2)
    with pytest.raises(DataError, match="length"):
        left_pad([[1, 2, 3]], length=2)
