"""OPT against PyTorch transformers: pre-LN (opt-125m style) and post-LN with a projected
embedding (opt-350m style) logits on left-padded batches, cached decoding, greedy generation,
folders written both ways, and loading on 1, 2 and 4 model shards."""

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
SIZES = dict(vocab_size=VOCAB, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, ffn_dim=48, dropout=0.0)
VARIANTS = {
    "pre_ln": {},
    # opt-350m: post-LN, no final LayerNorm, a 16-wide embedding projected in and out
    "post_ln_projected": {"do_layer_norm_before": False, "word_embed_proj_dim": 16},
    "no_bias_no_affine": {"enable_bias": False, "layer_norm_elementwise_affine": False},
}
_BUILT = {}


def build(variant, tmp_path_factory):
    if variant not in _BUILT:
        ref = randomize(transformers.OPTForCausalLM(transformers.OPTConfig(
            **SIZES, **VARIANTS[variant])), seed=len(_BUILT))
        folder = str(tmp_path_factory.mktemp(variant))
        ref.save_pretrained(folder)
        _BUILT[variant] = (ref, folder, *from_pretrained(folder))
    return _BUILT[variant]


@pytest.fixture(scope="module", params=["pre_ln", "post_ln_projected"])
def pair(request, tmp_path_factory):
    return build(request.param, tmp_path_factory)


@pytest.mark.parametrize("variant", [
    "pre_ln", "post_ln_projected",
    pytest.param("no_bias_no_affine", marks=pytest.mark.slow)])
def test_logits_match_transformers_on_a_left_padded_batch(variant, tmp_path_factory):
    ref, _, model, params = build(variant, tmp_path_factory)
    assert ("project_in" in params) == (variant == "post_ln_projected")
    assert ("final_layer_norm" in params) == (variant == "pre_ln")
    ids, mask = left_padded(VOCAB)
    got = np.asarray(jax.jit(model.apply)(params, ids, mask))
    want = torch_logits(ref, ids, mask)
    assert got.dtype == np.float32 and np.abs(want).max() > 0.5
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)


@pytest.mark.slow  # a few seconds more than the default suite affords; CI runs it
def test_cached_decoding_equals_the_full_forward_pass(tmp_path_factory):
    _, _, model, params = build("pre_ln", tmp_path_factory)
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


def test_greedy_generation_equals_transformers(tmp_path_factory):
    ref, _, model, params = build("post_ln_projected", tmp_path_factory)
    check_greedy_generation(ref, model, params, VOCAB)


def test_round_trip_through_transformers_is_exact(pair, tmp_path):
    ref, _, model, params = pair
    check_round_trip(ref, model, params, transformers.OPTForCausalLM, tmp_path)


@pytest.mark.slow  # a few seconds more than the default suite affords; CI runs it
def test_loaded_on_1_2_and_4_model_shards_gives_the_same_logits(tmp_path_factory, monkeypatch):
    _, folder, _, _ = build("post_ln_projected", tmp_path_factory)
    ids, mask = left_padded(VOCAB, seed=4)
    real = mask.astype(bool)
    check_sharded_loading(
        folder, monkeypatch, lambda m, p: np.asarray(jax.jit(m.apply)(p, ids, mask))[real],
        split_path=("layers", "0", "self_attn", "q_proj", "kernel"))
