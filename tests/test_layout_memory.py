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


@pytest.mark.slow  # 26 s: three runs of a Trainer
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
    from redcoast.layout_memory import LayoutMemory

    params = {"w": jax.ShapeDtypeStruct((4, 8), np.float32)}
    batch = {"ids": np.zeros((8, 12), np.int32)}
    memory = LayoutMemory.in_workdir(str(tmp_path), {"fsdp": [False, True]}, jax.devices())
    key = memory.key(params, batch)
    assert key == memory.key(params, {"ids": jax.ShapeDtypeStruct((8, 12), np.int32)})  # abstract
    assert key != memory.key(params, {"ids": np.zeros((16, 12), np.int32)})
    assert key != memory.key({"w": jax.ShapeDtypeStruct((4, 8), jax.numpy.bfloat16)}, batch)
    assert key != LayoutMemory.in_workdir(str(tmp_path), {"fsdp": [True]},
                                          jax.devices()).key(params, batch)
    assert key != LayoutMemory.in_workdir(str(tmp_path), {"fsdp": [False, True]},
                                          jax.devices()[:4]).key(params, batch)  # another run's devices
    chosen = Candidate(2, True, False)
    memory.remember(params, batch, chosen, "fastest")
    assert memory.recall(params, batch, Candidate) == chosen
    assert memory.recall(params, {"ids": np.zeros((16, 12), np.int32)}, Candidate) is None
    (tmp_path / "layout.json").write_text("{half a file")
    assert memory.recall(params, batch, Candidate) is None  # chosen again, then rewritten
