"""Layout.description: the mesh and the layout's choices said once each, FSDP honestly."""

from types import SimpleNamespace

from redcoast.layout.layout import BY_COST, Candidate, Layout


def described(n_data_shards, n_model_shards, fsdp, fuse_matmuls=True):
    layout = SimpleNamespace(candidate=Candidate(n_model_shards, fsdp, fuse_matmuls),
                             n_data_shards=n_data_shards, n_model_shards=n_model_shards)
    return Layout.description.fget(layout)


def test_each_choice_is_said_once_and_fsdp_over_one_data_shard_is_off():
    # was "dp=1 x mp=8, mp=8, fsdp=on, fusion=on" in redcoast plan's record
    assert described(1, 8, True) == "dp=1 x mp=8, fsdp=off (one data shard), fusion=on"
    assert described(1, 8, BY_COST) == "dp=1 x mp=8, fsdp=off (one data shard), fusion=on"
    assert described(4, 2, True, False) == "dp=4 x mp=2, fsdp=on, fusion=off"
    assert described(4, 2, BY_COST) == "dp=4 x mp=2, fsdp=by cost, fusion=on"
    assert described(8, 1, False) == "dp=8 x mp=1, fsdp=off, fusion=on"
