"""The layout a run chose is remembered in its workdir: the next run with the same model, batch,
devices and options compiles only that candidate; anything else in the key compares again."""

import json

import optax
import pytest

import redcoast.layout.layout
from redcoast import Deployer, Trainer
from tiny_lm import collate_fn, loss_fn, make_examples, make_model


@pytest.fixture
def compilations(monkeypatch):
    """How many candidate steps choose_layout compiled to compare them."""
    count = []
    lower = redcoast.layout.layout.lower_train_step
    monkeypatch.setattr(redcoast.layout.layout, "lower_train_step",
                        lambda *a, **k: count.append(1) or lower(*a, **k))
    return count


def run(workdir, per_device=2, n_model_shards="auto", **options):
    # 'auto': the numbers of model shards are compared by compiling (FSDP and fusion are not)
    model, params = make_model()
    trainer = Trainer(Deployer(jax_seed=0, n_model_shards=n_model_shards, workdir=str(workdir),
                               verbose=False),
                      collate_fn, model.apply, loss_fn, params, optax.adamw(1e-3), **options)
    trainer.fit(make_examples(32), per_device_batch_size=per_device, n_epochs=1, resume=False)
    return trainer


@pytest.mark.slow  # 26 s: three runs of a Trainer
def test_the_next_run_takes_the_remembered_layout_without_comparing(tmp_path, compilations):
    first = run(tmp_path)
    compared = len(compilations)
    assert compared >= 2 and len(first.layout.considered) == compared
    record = json.loads((tmp_path / "layout.json").read_text())
    assert record["candidate"] == {"n_model_shards": first.layout.n_model_shards,
                                   "fsdp": first.layout.candidate.fsdp,
                                   "fuse_matmuls": first.layout.candidate.fuse_matmuls}

    second = run(tmp_path)
    assert len(compilations) == compared  # nothing compiled to compare
    assert second.layout.candidate == first.layout.candidate
    assert "remembered from the run that chose it" in second.layout.reason

    run(tmp_path, n_model_shards=2)  # one candidate: nothing to compare or remember
    assert len(compilations) == compared
    assert json.loads((tmp_path / "layout.json").read_text()) == record


def test_the_key_holds_shapes_devices_and_options_and_bad_records_are_ignored(tmp_path):
    import jax
    import numpy as np

    from redcoast.layout.layout import Candidate
    from redcoast.layout.remembered import LayoutMemory

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
    assert memory.recall(params, batch, Candidate) == (chosen, str(tmp_path / "layout.json"))
    assert memory.recall(params, {"ids": np.zeros((16, 12), np.int32)}, Candidate) is None
    (tmp_path / "layout.json").write_text("{half a file")
    assert memory.recall(params, batch, Candidate) is None  # chosen again, then rewritten


def test_the_per_user_cache_remembers_across_workdirs(tmp_path):
    import jax
    import numpy as np

    from redcoast.layout.layout import Candidate
    from redcoast.layout.remembered import LayoutMemory

    params = {"w": jax.ShapeDtypeStruct((4, 8), np.float32)}
    batch = {"ids": np.zeros((8, 12), np.int32)}
    options, cache = {"fsdp": [False, True]}, str(tmp_path / "cache")
    first = LayoutMemory.in_workdir(str(tmp_path / "a"), options, jax.devices(), cache)
    first.remember(params, batch, Candidate(2, True, True), "fastest")
    key = first.key(params, batch)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [f"{key}.json"]

    fresh = LayoutMemory.in_workdir(str(tmp_path / "b"), options, jax.devices(), cache)
    assert fresh.recall(params, batch, Candidate) == (Candidate(2, True, True), f"{cache}/{key}.json")
    no_workdir = LayoutMemory.in_workdir(None, options, jax.devices(), cache)
    assert no_workdir.recall(params, batch, Candidate)[0] == Candidate(2, True, True)
    # the workdir's own record comes first; another key is not taken from the cache
    (tmp_path / "b").mkdir()
    fresh.remember(params, batch, Candidate(2, False, True), "mine")
    assert fresh.recall(params, batch, Candidate)[1] == str(tmp_path / "b" / "layout.json")
    other = LayoutMemory.in_workdir(None, {"fsdp": [True]}, jax.devices(), cache)
    assert other.recall(params, batch, Candidate) is None


@pytest.mark.slow  # 18 s: two runs of a Trainer
def test_a_new_workdir_takes_the_choice_from_the_per_user_cache(tmp_path, compilations, monkeypatch):
    import redcoast.store.user_cache

    monkeypatch.setattr(redcoast.store.user_cache, "layouts_directory", lambda: str(tmp_path / "cache"))
    first = run(tmp_path / "a")
    compared = len(compilations)
    assert compared >= 2
    second = run(tmp_path / "b")
    assert len(compilations) == compared  # nothing compiled to compare
    assert second.layout.candidate == first.layout.candidate
    assert str(tmp_path / "cache") in second.layout.reason
    record = json.loads((tmp_path / "b" / "layout.json").read_text())  # the workdir keeps its own
    assert record["candidate"]["fsdp"] == first.layout.candidate.fsdp
