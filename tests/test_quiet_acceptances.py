"""Files a run reads back that cannot apply are said and set aside, never obeyed into an error
that names neither the file nor the fix (issue 48, case 7)."""

import json

import pytest


def _memory_and_record(tmp_path, warnings):
    import jax
    import numpy as np

    from redcoast.layout.layout import BY_COST, Candidate
    from redcoast.layout.remembered import LayoutMemory

    params = {"w": jax.ShapeDtypeStruct((4, 8), np.float32)}
    batch = {"ids": np.zeros((8, 12), np.int32)}
    options = {"shard_counts": [1, 2, 4, 8], "fsdp": [BY_COST, False], "fuse_matmuls": [True]}
    memory = LayoutMemory.in_workdir(str(tmp_path), options, jax.devices(), warn=warnings.append)
    memory.remember(params, batch, Candidate(2, BY_COST, True), "fastest")
    return memory, params, batch, Candidate


@pytest.mark.parametrize("edit, why", [
    ({"n_model_shards": 3}, "n_model_shards=3 does not divide the run's 8 devices"),
    ({"n_model_shards": 0}, "n_model_shards=0 does not divide"),
    ({"n_model_shards": "2"}, "n_model_shards='2' does not divide"),
    ({"n_model_shards": True}, "n_model_shards=True does not divide"),
    ({"n_model_shards": 16}, "n_model_shards=16 does not divide"),
    ({"fsdp": "sometimes"}, "fsdp='sometimes' is not among this run's choices"),
    ({"fuse_matmuls": 1}, "fuse_matmuls=1 is not among this run's choices"),
    ({"mesh": [3, 3]}, "not the fields"),
])
def test_a_hand_edited_layout_json_that_cannot_apply_is_ignored_with_a_warning(tmp_path, edit, why):
    warnings = []
    memory, params, batch, Candidate = _memory_and_record(tmp_path, warnings)
    assert memory.recall(params, batch, Candidate)[0].n_model_shards == 2 and not warnings
    path = tmp_path / "layout.json"
    record = json.loads(path.read_text())
    record["candidate"].update(edit)
    path.write_text(json.dumps(record))
    assert memory.recall(params, batch, Candidate) is None  # chosen again, then rewritten
    assert len(warnings) == 1 and str(path) in warnings[0] and why in warnings[0], warnings


def test_a_damaged_layout_json_is_said_and_a_missing_one_is_not(tmp_path):
    warnings = []
    memory, params, batch, Candidate = _memory_and_record(tmp_path, warnings)
    (tmp_path / "layout.json").write_text("{half a file")
    assert memory.recall(params, batch, Candidate) is None
    assert len(warnings) == 1 and "cannot be read as JSON" in warnings[0]
    (tmp_path / "layout.json").unlink()
    assert memory.recall(params, batch, Candidate) is None and len(warnings) == 1


@pytest.mark.slow  # 2 runs of a Trainer: 20 to 60 s on 2 shared cores
def test_a_run_resumed_with_an_impossible_layout_json_chooses_again(tmp_path):
    import optax

    from redcoast import Deployer, Trainer
    from tiny_lm import collate_fn, loss_fn, make_examples, make_model

    def run():
        model, params = make_model()
        trainer = Trainer(Deployer(jax_seed=0, n_model_shards="auto", workdir=str(tmp_path),
                                   verbose=False),
                          collate_fn, model.apply, loss_fn, params, optax.adamw(1e-3))
        trainer.fit(make_examples(32), per_device_batch_size=2, n_epochs=1, resume=False)
        return trainer

    first = run()
    path = tmp_path / "layout.json"
    record = json.loads(path.read_text())
    record["candidate"]["n_model_shards"] = 3  # 8 devices: no mesh has 3 model shards
    path.write_text(json.dumps(record))
    second = run()  # before: ConfigError about n_model_shards=3, naming neither file nor fix
    assert second.layout.candidate == first.layout.candidate
    log = (tmp_path / "log.txt").read_text()
    assert f"{path} is ignored: n_model_shards=3 does not divide" in log
    assert json.loads(path.read_text())["candidate"]["n_model_shards"] == first.layout.n_model_shards
