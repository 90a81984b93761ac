"""The layout a run chose is remembered in its workdir: the next run with the same model, batch,
devices and options compiles only that candidate; anything else in the key compares again."""

import json

import optax
import pytest

import redcoast.layout
from redcoast import Deployer, Trainer
from tiny_lm import collate_fn, loss_fn, make_examples, make_model


@pytest.fixture
def compilations(monkeypatch):
    """How many candidate steps choose_layout compiled to compare them."""
    count = []
    lower = redcoast.layout.lower_train_step
    monkeypatch.setattr(redcoast.layout, "lower_train_step",
                        lambda *a, **k: count.append(1) or lower(*a, **k))
    return count


def run(workdir, per_device=2, **options):
    model, params = make_model()
    trainer = Trainer(Deployer(jax_seed=0, n_model_shards=2, workdir=str(workdir), verbose=False),
                      collate_fn, model.apply, loss_fn, params, optax.adamw(1e-3), **options)
    trainer.fit(make_examples(32), per_device_batch_size=per_device, n_epochs=1, resume=False)
    return trainer


def test_the_next_run_takes_the_remembered_layout_without_comparing(tmp_path, compilations):
    first = run(tmp_path)
    compared = len(compilations)
    assert compared >= 2 and len(first.layout.considered) == compared
    record = json.loads((tmp_path / "layout.json").read_text())
    assert record["candidate"] == {"n_model_shards": 2, "fsdp": first.layout.candidate.fsdp,
                                   "fuse_matmuls": first.layout.candidate.fuse_matmuls}

    second = run(tmp_path)
    assert len(compilations) == compared  # nothing compiled to compare
    assert second.layout.candidate == first.layout.candidate
    assert "remembered from the run that chose it" in second.layout.reason

    run(tmp_path, fsdp=False, fuse_matmuls=False)  # one candidate: nothing to compare or remember
    assert len(compilations) == compared
    assert json.loads((tmp_path / "layout.json").read_text()) == record


def test_the_key_holds_shapes_devices_and_options_and_bad_records_are_ignored(tmp_path):
    import jax
    import numpy as np

    from redcoast.layout import Candidate
    from redcoast.layout_memory import layout_key, recall, remember

    params = {"w": jax.ShapeDtypeStruct((4, 8), np.float32)}
    batch = {"ids": np.zeros((8, 12), np.int32)}
    key = layout_key(params, batch, jax.devices(), {"fsdp": [False, True]})
    assert key == layout_key(params, {"ids": jax.ShapeDtypeStruct((8, 12), np.int32)},
                             jax.devices(), {"fsdp": [False, True]})  # abstract or concrete
    for other in (layout_key(params, {"ids": np.zeros((16, 12), np.int32)}, jax.devices(),
                             {"fsdp": [False, True]}),
                  layout_key({"w": jax.ShapeDtypeStruct((4, 8), jax.numpy.bfloat16)}, batch,
                             jax.devices(), {"fsdp": [False, True]}),
                  layout_key(params, batch, jax.devices()[:4], {"fsdp": [False, True]}),
                  layout_key(params, batch, jax.devices(), {"fsdp": [True]})):
        assert other != key
    chosen = Candidate(2, True, False)
    remember(str(tmp_path), key, chosen, "fastest")
    assert recall(str(tmp_path), key, Candidate) == chosen
    assert recall(str(tmp_path), "another key", Candidate) is None
    (tmp_path / "layout.json").write_text("{half a file")
    assert recall(str(tmp_path), key, Candidate) is None  # chosen again, then rewritten
