"""GPT-J against PyTorch transformers: logits on a left-padded batch (partial interleaved rotary,
parallel block, untied head with bias), cached decoding, greedy generation, folders written both
ways, and loading on 1, 2 and 4 model shards."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_reference import (check_greedy_generation, check_round_trip, check_sharded_loading,
                          left_padded, randomize, torch_logits)
from redcoast.models import from_pretrained

torch = pytest.importorskip("torch", reason="test-only reference: pip install torch==2.13.0 transformers")
transformers = pytest.importorskip("transformers", reason="test-only reference: pip install transformers")

VOCAB = 96
# head_dim 8, rotary on its first 4 dimensions: the rotated and the passed parts both matter
SIZES = dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
             n_inner=48, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ref = randomize(transformers.GPTJForCausalLM(transformers.GPTJConfig(**SIZES)))
    folder = str(tmp_path_factory.mktemp("gptj"))
    ref.save_pretrained(folder)
    model, params = from_pretrained(folder)
    return ref, folder, model, params


def test_logits_match_transformers_on_a_left_padded_batch(tiny):
    ref, _, model, params = tiny
    ids, mask = left_padded(VOCAB)
    got = np.asarray(jax.jit(model.apply)(params, ids, mask))
    want = torch_logits(ref, ids, mask)
    assert got.dtype == np.float32 and np.abs(want).max() > 0.5
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)


@pytest.mark.slow  # a few seconds more than the default suite affords; CI runs it
def test_full_rotary_matches_transformers(tmp_path):
    """rotary_dim = head_dim: every dimension of the head is rotated."""
    ref = randomize(transformers.GPTJForCausalLM(transformers.GPTJConfig(
        **{**SIZES, "rotary_dim": 8})), seed=1)
    ref.save_pretrained(tmp_path)
    model, params = from_pretrained(tmp_path)
    assert model.config.rotary_dim == model.config.head_dim
    ids, mask = left_padded(VOCAB, seed=1)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(jax.jit(model.apply)(params, ids, mask))[real],
                               torch_logits(ref, ids, mask)[real], atol=1e-4, rtol=0)


@pytest.mark.slow  # a few seconds more than the default suite affords; CI runs it
def test_cached_decoding_equals_the_full_forward_pass(tiny):
    _, _, model, params = tiny
    ids, mask = left_padded(VOCAB, t=10, seed=2)
    full = np.asarray(jax.jit(model.apply)(params, ids, mask))
    max_len, prompt = 12, 6
    slot_mask = np.pad(mask, ((0, 0), (0, max_len - 10)))
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    step = jax.jit(lambda p, x, pos, c, i: model.apply(p, x, slot_mask, pos, c, i))
    logits, cache = step(params, ids[:, :prompt], positions[:, :prompt],
                         model.init_cache(3, max_len), jnp.int32(0))
    got = [np.asarray(logits)]
    for t in range(prompt, 10):
        logits, cache = step(params, ids[:, t:t + 1], positions[:, t:t + 1], cache, jnp.int32(t))
        got.append(np.asarray(logits))
    real = mask.astype(bool)
    np.testing.assert_allclose(np.concatenate(got, 1)[real], full[real], atol=1e-5, rtol=0)


def test_greedy_generation_equals_transformers(tiny):
    ref, _, model, params = tiny
    check_greedy_generation(ref, model, params, VOCAB)


def test_round_trip_through_transformers_is_exact(tiny, tmp_path):
    ref, _, model, params = tiny
    check_round_trip(ref, model, params, transformers.GPTJForCausalLM, tmp_path)


@pytest.mark.slow  # a few seconds more than the default suite affords; CI runs it
def test_loaded_on_1_2_and_4_model_shards_gives_the_same_logits(tiny, monkeypatch):
    _, folder, _, _ = tiny
    ids, mask = left_padded(VOCAB, seed=4)
    real = mask.astype(bool)
    check_sharded_loading(
        folder, monkeypatch, lambda m, p: np.asarray(jax.jit(m.apply)(p, ids, mask))[real],
        split_path=("h", "0", "attn", "q_proj", "kernel"))
