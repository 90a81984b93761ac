"""BART against PyTorch transformers: logits with padded encoder and decoder inputs (scaled and
unscaled embeddings), cached decoding, greedy and beam generation (with transformers' processors,
and BART-CNN's own generation config), folders written both ways, and loading on 1, 2 and 4
model shards."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_reference import check_round_trip, check_sharded_loading, randomize, same_tokens
from redcoast.models import bart, from_pretrained
from redcoast.models.generate_seq2seq import generate

torch = pytest.importorskip("torch", reason="test-only reference: pip install torch==2.13.0 transformers")
transformers = pytest.importorskip("transformers", reason="test-only reference: pip install transformers")

VOCAB, D = 64, 16
SIZES = dict(vocab_size=VOCAB, max_position_embeddings=32, d_model=D, encoder_layers=1,
             decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=32, decoder_ffn_dim=24, dropout=0.0, forced_eos_token_id=None)
VARIANTS = {"bart": {}, "scaled_embedding": {"scale_embedding": True}}
_BUILT = {}


def build(variant, tmp_path_factory):
    if variant not in _BUILT:
        ref = transformers.BartForConditionalGeneration(transformers.BartConfig(
            **SIZES, **VARIANTS[variant]))
        randomize(ref, seed=len(_BUILT))
        with torch.no_grad():  # a buffer, untouched by randomize: make it matter
            ref.final_logits_bias.normal_(0.0, 0.5)
        folder = str(tmp_path_factory.mktemp(variant))
        ref.save_pretrained(folder)
        model, params = from_pretrained(folder)
        _BUILT[variant] = ref, folder, model, params, jax.jit(model.apply)
    return _BUILT[variant]


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    return build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return build("bart", tmp_path_factory)


def batch(seed=0):
    """Encoder inputs padded on the left (row 1) and on the right (row 2); decoder inputs
    padded on the right (row 1)."""
    rs = np.random.RandomState(seed)
    ids = rs.randint(3, VOCAB, (3, 12))
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    mask[2, 7:] = 0
    ids[mask == 0] = 1
    dec = rs.randint(3, VOCAB, (3, 9))
    dec[:, 0] = 2
    dec_mask = np.ones_like(dec)
    dec_mask[1, 6:] = 0
    return ids, mask, dec, dec_mask


def torch_logits(ref, ids, mask, dec, dec_mask):
    with torch.no_grad():
        return ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                   decoder_input_ids=torch.tensor(dec),
                   decoder_attention_mask=torch.tensor(dec_mask)).logits.numpy()


def test_logits_match_transformers(pair):
    ref, _, model, params, forward = pair
    args = batch()
    want = torch_logits(ref, *args)
    got = np.asarray(forward(params, *args))
    assert got.dtype == np.float32 and np.abs(want).max() > 0.5
    real = args[3].astype(bool)  # padded decoder positions are not compared
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)


def test_shift_right_matches_transformers(plain):
    _, _, model, _, _ = plain
    labels = np.array([[5, 6, 7, 2], [8, 9, -100, -100]])
    want = transformers.models.bart.modeling_bart.shift_tokens_right(
        torch.tensor(labels), model.config.pad_token_id, model.config.decoder_start_token_id)
    np.testing.assert_array_equal(bart.shift_right(jnp.asarray(labels), model.config), want.numpy())


@pytest.mark.slow  # a few seconds more than the default suite affords; CI runs it
def test_cached_decoding_equals_full_decode(plain):
    _, _, model, params, forward = plain
    ids, mask, dec, _ = batch(1)
    full = np.asarray(forward(params, ids, mask, dec, np.ones_like(dec)))
    enc = model.apply(params, ids, mask, method="encode")
    cross_kv = model.apply(params, enc, method="cross_kv")
    n = dec.shape[1]
    key_mask = jnp.ones((3, n + 2), jnp.int32)
    step = jax.jit(lambda p, tok, c, i: model.apply(
        p, tok, None, mask, attention_mask=key_mask, cache=c, cache_index=i, cross_kv=cross_kv,
        method="decode"))
    logits, cache = step(params, dec[:, :4], model.init_cache(3, n + 2), jnp.int32(0))
    pieces = [logits]
    for i in range(4, n):
        logits, cache = step(params, dec[:, i:i + 1], cache, jnp.int32(i))
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=0)


def _hf_generate(ref, ids, mask, **kw):
    with torch.no_grad():
        out = ref.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                           do_sample=False, forced_bos_token_id=None, forced_eos_token_id=None,
                           no_repeat_ngram_size=0, pad_token_id=1, **kw)
    return out.numpy()[:, 1:]  # without the decoder start token


@pytest.mark.parametrize("num_beams", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_generation_matches_transformers(plain, num_beams):
    ref, _, model, params, _ = plain
    ids, mask, _, _ = batch(2)
    free = _hf_generate(ref, ids, mask, num_beams=1, max_new_tokens=10, eos_token_id=None)
    eos = int(free[1, 2])  # a token the model does produce, as EOS: rows stop at different steps
    want = _hf_generate(ref, ids, mask, num_beams=num_beams, max_new_tokens=10, eos_token_id=eos,
                        length_penalty=1.0, early_stopping=False)
    assert num_beams > 1 or (want == eos).any()
    got = generate(model, params, ids, mask, max_new_tokens=10, num_beams=num_beams,
                   eos_token_id=eos, pad_token_id=1)
    same_tokens(got, want, eos, pad=1)


@pytest.mark.parametrize("options", [  # three in the slow step: the default suite is near its time
    pytest.param(dict(no_repeat_ngram_size=2), marks=pytest.mark.slow),
    pytest.param(dict(repetition_penalty=1.8), marks=pytest.mark.slow),
    dict(forced_bos_token_id=0, forced_eos_token_id=2),
    pytest.param(dict(min_new_tokens=6), marks=pytest.mark.slow)],
    ids=["no_repeat_bigrams", "repetition_penalty", "forced_bos_eos", "min_new_tokens"])
def test_logits_processors_match_transformers(plain, options):
    """transformers' processors on the decoder, whose history starts with the start token."""
    ref, _, model, params, _ = plain
    ids, mask, _, _ = batch(2)
    free = _hf_generate(ref, ids, mask, num_beams=1, max_new_tokens=10, eos_token_id=None)
    # min_new_tokens: an EOS the model gives early; otherwise one it never gives (whole rows)
    eos = int(free[1, 2]) if "min_new_tokens" in options else next(
        t for t in range(3, 64) if t not in free)
    with torch.no_grad():
        want = ref.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                            do_sample=False, pad_token_id=1, max_new_tokens=10, eos_token_id=eos,
                            **{"forced_bos_token_id": None, "forced_eos_token_id": None,
                               "no_repeat_ngram_size": 0, **options}).numpy()[:, 1:]
    got = generate(model, params, ids, mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=1,
                   **options)
    plain_got = generate(model, params, ids, mask, max_new_tokens=10, eos_token_id=eos,
                         pad_token_id=1)
    assert not np.array_equal(got, plain_got), "the option changed nothing here: a useless test"
    same_tokens(got, want, eos, pad=1)


def cnn_style_folder(folder, tmp_path, eos):
    """A copy of ``folder`` with facebook/bart-large-cnn's generation_config.json, but ``eos``
    (a token the random model does give) for EOS and forced EOS and a shorter min_length."""
    copy = tmp_path / "cnn_style"
    shutil.copytree(folder, copy)
    (copy / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "decoder_start_token_id": 2, "early_stopping": True,
         "eos_token_id": eos, "forced_bos_token_id": 0, "forced_eos_token_id": eos,
         "length_penalty": 2.0, "max_length": 142, "min_length": 8, "no_repeat_ngram_size": 3,
         "num_beams": 4, "pad_token_id": 1}))
    return copy


def test_beam_search_with_bart_cnns_generation_config_matches_transformers(plain, tmp_path):
    """A summariser run as its authors configured it: four beams, no repeated trigram, length
    penalty 2, a minimum length and forced BOS/EOS, all read from generation_config.json by
    redcoast and transformers alike."""
    ref, folder, _, _, _ = plain
    ids, mask, _, _ = batch(2)
    free = _hf_generate(ref, ids, mask, num_beams=1, max_new_tokens=12, eos_token_id=None)
    eos = int(free[1, 2])
    folder = cnn_style_folder(folder, tmp_path, eos)
    model, params = from_pretrained(folder)
    hf = transformers.BartForConditionalGeneration.from_pretrained(folder).eval()
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                           max_new_tokens=12).numpy()[:, 1:]
    got = generate(model, params, ids, mask, max_new_tokens=12)  # no option given
    assert (want[:, 0] == 0).all() and (want == eos).any()
    same_tokens(got, want, eos, pad=1)
    plain_beams = generate(model, params, ids, mask, max_new_tokens=12, no_repeat_ngram_size=0,
                           min_length=0, length_penalty=1.0)
    assert not np.array_equal(got, plain_beams), "the file changed nothing here: a useless test"


@pytest.mark.slow  # a beam search compiled per option
@pytest.mark.parametrize("options", [
    dict(no_repeat_ngram_size=2), dict(repetition_penalty=1.8),
    dict(forced_bos_token_id=0, forced_eos_token_id=2), dict(min_new_tokens=6),
    dict(min_length=7)],
    ids=["no_repeat_bigrams", "repetition_penalty", "forced_bos_eos", "min_new_tokens",
         "min_length"])
def test_logits_processors_with_beam_search_match_transformers(plain, options):
    """Each processor on every beam's log-probabilities and own history; min_length counts the
    decoder's start token, as in transformers."""
    ref, _, model, params, _ = plain
    ids, mask, _, _ = batch(2)
    free = _hf_generate(ref, ids, mask, num_beams=3, max_new_tokens=10, eos_token_id=None)
    minimum = any(name.startswith("min_") for name in options)
    # min length: the best beam's first token as EOS and no length penalty, so every row ends
    # at once without the option; otherwise a token it gives later
    eos = int(free[0, 0]) if minimum else int(free[1, 2])
    kw = dict(num_beams=3, max_new_tokens=10, eos_token_id=eos,
              length_penalty=0.0 if minimum else 1.0, early_stopping=False)
    with torch.no_grad():
        want = ref.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                            do_sample=False, pad_token_id=1, **kw,
                            **{"forced_bos_token_id": None, "forced_eos_token_id": None,
                               "no_repeat_ngram_size": 0, **options}).numpy()[:, 1:]
    got = generate(model, params, ids, mask, pad_token_id=1, **kw, **options)
    plain_beams = generate(model, params, ids, mask, pad_token_id=1, **kw)
    assert not np.array_equal(got, plain_beams), "the option changed nothing here: a useless test"
    same_tokens(got, want, eos, pad=1)


def test_round_trip_through_transformers_is_exact(plain, tmp_path):
    ref, _, model, params, _ = plain
    check_round_trip(ref, model, params, transformers.BartForConditionalGeneration, tmp_path)


@pytest.mark.slow  # a few seconds more than the default suite affords; CI runs it
def test_loaded_on_1_2_and_4_model_shards_gives_the_same_logits(plain, monkeypatch):
    _, folder, _, _, _ = plain
    args = batch(3)
    real = args[3].astype(bool)
    check_sharded_loading(
        folder, monkeypatch, lambda m, p: np.asarray(jax.jit(m.apply)(p, *args))[real],
        split_path=("decoder", "layers", "1", "encoder_attn", "q_proj", "kernel"))
