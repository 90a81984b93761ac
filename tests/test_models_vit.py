"""ViT against PyTorch transformers' ViTModel: features and pooled output, folders written both
ways (with and without a pooler), and loading on 1, 2 and 4 model shards."""

import jax
import numpy as np
import pytest

from hf_reference import check_sharded_loading, randomize
from redcoast.models import Model, from_pretrained, save_pretrained, vit

torch = pytest.importorskip("torch", reason="test-only reference: pip install torch==2.13.0 transformers")
transformers = pytest.importorskip("transformers", reason="test-only reference: pip install transformers")

SIZES = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, intermediate_size=48, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ref = randomize(transformers.ViTModel(transformers.ViTConfig(**SIZES)))
    folder = str(tmp_path_factory.mktemp("vit"))
    ref.save_pretrained(folder)
    return ref, folder, *from_pretrained(folder)


def pixels(seed=0, batch=3):
    return np.random.RandomState(seed).randn(batch, 3, 16, 16).astype(np.float32)


def test_features_match_transformers(tiny):
    ref, _, model, params = tiny
    x = pixels()
    hidden, pooled = jax.jit(model.apply)(params, x)
    with torch.no_grad():
        want = ref(pixel_values=torch.tensor(x))
    assert hidden.shape == (3, 17, 32) and np.abs(want.last_hidden_state.numpy()).max() > 0.5
    np.testing.assert_allclose(np.asarray(hidden), want.last_hidden_state.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(pooled), want.pooler_output.numpy(), atol=1e-4, rtol=0)


def test_round_trip_through_transformers_is_exact(tiny, tmp_path):
    ref, _, model, params = tiny
    save_pretrained(model, params, str(tmp_path / "ours"))
    back = transformers.ViTModel.from_pretrained(str(tmp_path / "ours")).state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(back[name], value), name


def test_in_memory_tensors_load_like_the_folder(tiny):
    from redcoast.models import hf
    from redcoast.models.pretrained import from_reader

    _, folder, _, params = tiny
    reader = hf.SafetensorsFolder(folder)
    tensors = {name: reader.read(name) for name in reader.names()}
    model, again = from_reader(hf.read_config(folder), hf.TensorDict(tensors))
    assert model.config.add_pooling_layer  # asked of the tensors, not of config.json
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, again)


@pytest.mark.slow  # a few seconds more than the default suite affords; CI runs it
def test_a_folder_without_pooler_loads_and_saves_without_one(tmp_path):
    ref = randomize(transformers.ViTModel(transformers.ViTConfig(**SIZES), add_pooling_layer=False),
                    seed=1)
    ref.save_pretrained(tmp_path / "theirs")
    model, params = from_pretrained(str(tmp_path / "theirs"))
    assert not model.config.add_pooling_layer and "pooler" not in params
    x = pixels(1)
    hidden, pooled = jax.jit(model.apply)(params, x)
    with torch.no_grad():
        want = ref(pixel_values=torch.tensor(x)).last_hidden_state.numpy()
    assert pooled is None
    np.testing.assert_allclose(np.asarray(hidden), want, atol=1e-4, rtol=0)
    fresh = Model(vit.ViTModel, model.config)
    new = fresh.init(seed=2)
    save_pretrained(fresh, new, str(tmp_path / "ours"))
    _, again = from_pretrained(str(tmp_path / "ours"))
    jax.tree_util.tree_map(np.testing.assert_array_equal, new, again)


@pytest.mark.slow  # a few seconds more than the default suite affords; CI runs it
def test_loaded_on_1_2_and_4_model_shards_gives_the_same_features(tiny, monkeypatch):
    _, folder, _, _ = tiny
    x = pixels(2)
    check_sharded_loading(folder, monkeypatch,
                          lambda m, p: [np.asarray(a) for a in jax.jit(m.apply)(p, x)],
                          split_path=("layers", "0", "query", "kernel"))
