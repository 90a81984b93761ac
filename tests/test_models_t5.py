"""T5 against PyTorch transformers: v1.0 (ReLU, tied, scaled head) and v1.1 (gated-GELU, own
lm_head) logits with padded inputs, cached decoding, greedy and beam generation, sharded loading,
and Hugging Face folders written and read both ways."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import redcoast
from redcoast.models import Model, from_pretrained, save_pretrained, t5
from redcoast.models.generate_seq2seq import generate

torch = pytest.importorskip("torch", reason="test-only reference: pip install torch==2.13.0 transformers")
transformers = pytest.importorskip("transformers", reason="test-only reference: pip install transformers")

VOCAB, D = 64, 16
# 8 buckets reaching 12 positions with 20-token inputs: exact, logarithmic and clipped offsets
SIZES = {"vocab_size": VOCAB, "d_model": D, "d_kv": 4, "d_ff": 32, "num_layers": 1,
         "num_decoder_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
         "relative_attention_max_distance": 12, "decoder_start_token_id": 0, "pad_token_id": 0,
         "eos_token_id": 1, "dropout_rate": 0.0}
VARIANTS = {"v1.0": {"feed_forward_proj": "relu", "tie_word_embeddings": True},
            "v1.1": {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}}


def reference(variant, seed=0):
    """A random transformers T5; v1.1 gets an lm_head of its own (transformers 5 ties it to the
    embedding at construction, while real v1.1 / flan-t5 checkpoints store both)."""
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(
        transformers.T5Config(**SIZES, **VARIANTS[variant])).eval()
    if not model.config.scale_decoder_outputs:
        model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, D))
    return model


_BUILT = {}


def _build(variant, tmp_path_factory):
    """(variant, transformers model, its folder, redcoast model, params, jitted forward), once
    per variant for the whole module."""
    if variant not in _BUILT:
        folder = tmp_path_factory.mktemp(variant)
        ref = reference(variant)
        ref.save_pretrained(folder)
        model, params = from_pretrained(folder)
        _BUILT[variant] = variant, ref, folder, model, params, jax.jit(model.apply)
    return _BUILT[variant]


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def v11(tmp_path_factory):
    """The v1.1 model only (own lm_head, gated FFN), for tests that need one variant."""
    return _build("v1.1", tmp_path_factory)


def batch(seed=0):
    rs = np.random.RandomState(seed)
    ids = rs.randint(2, VOCAB, (2, 20)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 13:] = 0  # padding on the right of the second input
    dec = rs.randint(2, VOCAB, (2, 17)).astype(np.int32)
    dec[:, 0] = 0
    dec_mask = np.ones_like(dec)
    dec_mask[1, 10:] = 0
    return ids, mask, dec, dec_mask


def torch_logits(ref, ids, mask, dec, dec_mask):
    with torch.no_grad():
        out = ref(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                  decoder_input_ids=torch.tensor(dec, dtype=torch.long),
                  decoder_attention_mask=torch.tensor(dec_mask))
    return out.logits.numpy()


def test_bucket_table_matches_transformers():
    bucket = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket
    rel = np.arange(-300, 301)
    for buckets, distance in [(32, 128), (8, 12), (16, 20), (32, 64)]:
        for bidirectional in (True, False):
            want = bucket(torch.tensor(rel), bidirectional, buckets, distance).numpy()
            table = t5.bucket_table(buckets, distance, bidirectional)
            got = table[np.clip(rel, -distance, distance) + distance]
            np.testing.assert_array_equal(got, want)


def test_logits_match_transformers(pair):
    variant, ref, _, model, params, forward = pair
    assert model.config.tie_word_embeddings == (variant == "v1.0")
    assert model.config.scale_decoder_outputs == (variant == "v1.0")
    assert ("lm_head" in params) == (variant == "v1.1")
    ids, mask, dec, dec_mask = batch()
    want = torch_logits(ref, ids, mask, dec, dec_mask)
    got = np.asarray(forward(params, ids, mask, dec, dec_mask))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_shift_right_matches_transformers(pair):
    _, ref, _, model, _, _ = pair
    labels = np.array([[5, 6, 7, 1], [8, 9, -100, -100]])
    want = ref._shift_right(torch.tensor(labels)).numpy()
    np.testing.assert_array_equal(t5.shift_right(jnp.asarray(labels), model.config), want)


def test_cached_decoding_equals_full_decode(v11):
    _, _, _, model, params, forward = v11
    ids, mask, dec, dec_mask = batch(1)
    full = forward(params, ids, mask, dec, np.ones_like(dec_mask))  # no decoder padding
    enc = jax.jit(lambda p: model.apply(p, ids, mask, method="encode"))(params)
    cross_kv = jax.jit(lambda p: model.apply(p, enc, method="cross_kv"))(params)
    n = dec.shape[1]
    cache = model.init_cache(2, n + 3)
    key_mask = jnp.ones((2, n + 3), jnp.int32)
    step = jax.jit(lambda p, tok, c, i: model.apply(
        p, tok, enc, mask, attention_mask=key_mask, cache=c, cache_index=i, cross_kv=cross_kv,
        method="decode"))
    # prefill 5 tokens, then one token at a time
    logits, cache = step(params, dec[:, :5], cache, jnp.int32(0))
    pieces = [logits]
    for i in range(5, n):
        logits, cache = step(params, dec[:, i:i + 1], cache, jnp.int32(i))
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=0)


def _hf_generate(ref, ids, mask, **kw):
    with torch.no_grad():
        out = ref.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                           attention_mask=torch.tensor(mask), do_sample=False,
                           use_cache=False, **kw)  # its cache assumes as many decoder as encoder layers
    return out.numpy()[:, 1:]  # without the decoder start token


def _same_tokens(ours, theirs, eos, pad=0):
    """Equal up to each row's first EOS, and padded with ``pad`` after it (transformers' beam
    search fills with EOS instead when pad_token_id is 0, as it tests ``pad_token_id or eos``)."""
    ours = np.asarray(ours)
    ended = np.cumsum(np.cumsum(theirs == eos, axis=1), axis=1) > 1  # after the first EOS
    np.testing.assert_array_equal(ours[:, :theirs.shape[1]], np.where(ended, pad, theirs))
    assert (ours[:, theirs.shape[1]:] == pad).all()


@pytest.mark.parametrize("num_beams", [1, 3])
def test_generation_matches_transformers(pair, num_beams):
    _, ref, _, model, params, _ = pair
    ids, mask, _, _ = batch(2)
    free = _hf_generate(ref, ids, mask, num_beams=1, max_new_tokens=10, eos_token_id=None)
    # a token the model does produce, as EOS: rows stop at different steps
    eos = int(free[1, 2])
    want = _hf_generate(ref, ids, mask, num_beams=num_beams, max_new_tokens=10, eos_token_id=eos,
                        length_penalty=1.0, early_stopping=False)
    assert num_beams > 1 or (want == eos).any()
    got = generate(model, params, ids, mask, max_new_tokens=10, num_beams=num_beams,
                   eos_token_id=eos)
    _same_tokens(got, want, eos)


def test_sharded_loading_gives_the_same_logits(v11):
    _, _, folder, _, params, forward = v11
    deployer = redcoast.Deployer(n_model_shards=2, verbose=False)
    sharded_model, sharded = from_pretrained(folder, deployer)
    q = sharded["decoder"]["blocks"]["1"]["cross_attn"]["q"]["kernel"]
    assert "mp" in str(q.sharding.spec)  # heads really are split over the model shards
    ids, mask, dec, dec_mask = batch()
    want = np.asarray(forward(params, ids, mask, dec, dec_mask))
    got = np.asarray(jax.jit(sharded_model.apply)(sharded, ids, mask, dec, dec_mask))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_remat_gives_the_same_logits_and_recomputes():
    config = t5.Config(vocab_size=VOCAB, d_model=D, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
                       relative_attention_num_buckets=8, relative_attention_max_distance=12,
                       feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    plain = Model(t5.T5ForConditionalGeneration, config)
    remat = Model(t5.T5ForConditionalGeneration, dataclasses.replace(config, remat=True))
    params = plain.init(1)
    args = batch()
    np.testing.assert_allclose(jax.jit(remat.apply)(params, *args),
                               jax.jit(plain.apply)(params, *args), atol=1e-6, rtol=0)

    def grad_jaxpr(m):  # traced only: remat shows as checkpointed sub-computations
        return str(jax.make_jaxpr(jax.grad(lambda p: jnp.mean(m.apply(p, *args) ** 2)))(params))

    assert "checkpoint" in grad_jaxpr(remat) or "remat" in grad_jaxpr(remat)
    assert "checkpoint" not in grad_jaxpr(plain) and "remat" not in grad_jaxpr(plain)


def test_hf_folder_round_trips_exactly(pair, tmp_path):
    _, ref, folder, model, params, _ = pair
    from safetensors.numpy import load_file

    save_pretrained(model, params, tmp_path)
    original = load_file(folder / "model.safetensors")
    ours = load_file(tmp_path / "model.safetensors")
    assert sorted(ours) == sorted(original)
    for name in original:
        np.testing.assert_array_equal(ours[name], original[name], err_msg=name)
    reloaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    args = batch()
    np.testing.assert_array_equal(torch_logits(reloaded, *args), torch_logits(ref, *args))


def test_redcoast_params_round_trip_through_transformers(tmp_path):
    """Random redcoast params (v1.1) -> folder -> transformers -> its folder -> redcoast."""
    hf = {k: v for k, v in {**SIZES, **VARIANTS["v1.1"]}.items() if k != "dropout_rate"}
    model = Model(t5.T5ForConditionalGeneration, t5.Config.from_hf(hf))
    params = model.init(3)
    save_pretrained(model, params, tmp_path / "ours")
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "ours")
    assert not theirs.config.scale_decoder_outputs
    assert not torch.equal(theirs.lm_head.weight, theirs.shared.weight)
    theirs.save_pretrained(tmp_path / "theirs")
    back_model, back = from_pretrained(tmp_path / "theirs")
    assert back_model.config == model.config
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)
