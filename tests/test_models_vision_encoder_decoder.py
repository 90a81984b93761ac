"""ViT + GPT-2 with cross-attention (transformers' VisionEncoderDecoderModel, the paper's
captioning layout) against PyTorch: logits with padded captions, cached decoding, greedy and beam
captions, folders written both ways, and loading on 1, 2 and 4 model shards."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_reference import check_round_trip, check_sharded_loading, randomize, same_tokens
from redcoast.models import from_pretrained
from redcoast.models import vision_encoder_decoder as ved
from redcoast.models.generate_seq2seq import generate

torch = pytest.importorskip("torch", reason="test-only reference: pip install torch==2.13.0 transformers")
transformers = pytest.importorskip("transformers", reason="test-only reference: pip install transformers")

VOCAB = 48
ENCODER = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
               num_attention_heads=4, intermediate_size=24, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
# decoder wider than the encoder: enc_to_dec_proj is used
DECODER = dict(vocab_size=VOCAB, n_positions=24, n_embd=32, n_layer=2, n_head=4,
               add_cross_attention=True, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
               embd_pdrop=0.0, attn_pdrop=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        transformers.ViTConfig(**ENCODER), transformers.GPT2Config(**DECODER))
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 0, 1, 0
    ref = randomize(transformers.VisionEncoderDecoderModel(config))
    folder = str(tmp_path_factory.mktemp("ved"))
    ref.save_pretrained(folder)
    model, params = from_pretrained(folder)
    return ref, folder, model, params


def inputs(seed=0):
    rs = np.random.RandomState(seed)
    pixels = rs.randn(3, 3, 16, 16).astype(np.float32)
    dec = rs.randint(2, VOCAB, (3, 7))
    dec[:, 0] = 0
    dec_mask = np.ones_like(dec)
    dec_mask[1, 4:] = 0  # a shorter caption, padded on the right
    return pixels, dec, dec_mask


def test_logits_match_transformers(tiny):
    ref, _, model, params = tiny
    assert "enc_to_dec_proj" in params and model.config.encoder.add_pooling_layer
    pixels, dec, dec_mask = inputs()
    with torch.no_grad():
        want = ref(pixel_values=torch.tensor(pixels), decoder_input_ids=torch.tensor(dec),
                   decoder_attention_mask=torch.tensor(dec_mask)).logits.numpy()
    got = np.asarray(jax.jit(model.apply)(params, pixels, dec, dec_mask))
    assert got.dtype == np.float32 and np.abs(want).max() > 0.5
    real = dec_mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)


@pytest.mark.slow  # a few seconds more than the default suite affords; CI runs it
def test_cached_decoding_equals_full_decode(tiny):
    _, _, model, params = tiny
    pixels, dec, _ = inputs(1)
    full = np.asarray(jax.jit(model.apply)(params, pixels, dec))
    enc = model.apply(params, pixels, method="encode")
    cross_kv = model.apply(params, enc, method="cross_kv")
    n = dec.shape[1]
    key_mask = jnp.ones((3, n + 2), jnp.int32)
    step = jax.jit(lambda p, tok, c, i: model.apply(
        p, tok, None, attention_mask=key_mask, cache=c, cache_index=i, cross_kv=cross_kv,
        method="decode"))
    logits, cache = step(params, dec[:, :3], model.init_cache(3, n + 2), jnp.int32(0))
    pieces = [logits]
    for i in range(3, n):
        logits, cache = step(params, dec[:, i:i + 1], cache, jnp.int32(i))
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_beams", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_captions_match_transformers(tiny, num_beams):
    ref, _, model, params = tiny
    pixels, _, _ = inputs(2)
    kw = dict(pixel_values=torch.tensor(pixels), do_sample=False, max_new_tokens=8,
              decoder_start_token_id=0, pad_token_id=1)
    with torch.no_grad():
        free = ref.generate(**kw, eos_token_id=None, num_beams=1).numpy()[:, 1:]
        eos = int(free[1, 2])  # a token the model does produce: captions end at different steps
        want = ref.generate(**kw, eos_token_id=eos, num_beams=num_beams, length_penalty=1.0,
                            early_stopping=False).numpy()[:, 1:]
    got = generate(model, params, pixels, max_new_tokens=8, num_beams=num_beams,
                   eos_token_id=eos, pad_token_id=1, decoder_start_token_id=0)
    assert num_beams > 1 or (want == eos).any()
    same_tokens(got, want, eos, pad=1)


def test_round_trip_through_transformers_is_exact(tiny, tmp_path):
    ref, _, model, params = tiny
    back = check_round_trip(ref, model, params, transformers.VisionEncoderDecoderModel, tmp_path)
    assert back.config.decoder_start_token_id == 0 and back.config.pad_token_id == 1


@pytest.mark.slow  # a few seconds more than the default suite affords; CI runs it
def test_loaded_on_1_2_and_4_model_shards_gives_the_same_logits(tiny, monkeypatch):
    _, folder, _, _ = tiny
    pixels, dec, dec_mask = inputs(3)
    real = dec_mask.astype(bool)
    check_sharded_loading(
        folder, monkeypatch,
        lambda m, p: np.asarray(jax.jit(m.apply)(p, pixels, dec, dec_mask))[real],
        split_path=("decoder", "h", "1", "crossattention", "c_attn", "kernel"))


def test_unsupported_layouts_are_clear_errors():
    from redcoast.errors import ConfigError
    from redcoast.models import bart, gptj, opt

    with pytest.raises(ConfigError, match="ViT \\+ GPT-2 only"):
        ved.Config.from_hf({"encoder": {"model_type": "vit"}, "decoder": {"model_type": "bert"}})
    with pytest.raises(ConfigError, match="LM head is a matrix of its own"):
        gptj.Config.from_hf({"tie_word_embeddings": True})
    with pytest.raises(ConfigError, match="ties its LM head"):
        opt.Config.from_hf({"tie_word_embeddings": False})
    with pytest.raises(ConfigError, match="mBART"):
        bart.Config.from_hf({"normalize_before": True})
    with pytest.raises(ConfigError, match="activation_function='swiglu'"):
        opt.Config(activation_function="swiglu")
