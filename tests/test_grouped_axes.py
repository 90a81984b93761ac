"""Splits over consecutive groups of the model shards ('mp:k'): where the blocks land, how the
plan counts and checks them, and how FSDP stores them."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from redcoast.errors import ConfigError
from redcoast.sharding.fsdp import fsdp_placements
from redcoast.sharding.grouped_axes import named_sharding, parse, per_device_pieces
from redcoast.sharding.rules import Placement, check_spec_fits


def _mesh(dp, mp):
    return jax.make_mesh((dp, mp), ("dp", "mp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_each_group_of_consecutive_model_shards_holds_one_block():
    mesh = _mesh(2, 4)
    x = jax.device_put(np.arange(2 * 8, dtype=np.float32).reshape(2, 8), named_sharding(mesh, P(None, "mp:2")))
    for dp in range(2):
        for mp in range(4):
            device = mesh.devices[dp, mp]
            shard, = [s for s in x.addressable_shards if s.device == device]
            block = mp // 2  # shards 0, 1 hold the first half; 2, 3 the second
            np.testing.assert_array_equal(shard.data, np.asarray(x)[:, block * 4:(block + 1) * 4])


def test_a_grouped_split_beside_dp_and_whole_mp_entries():
    mesh = _mesh(2, 4)
    s = named_sharding(mesh, P("dp", "mp:2"))
    x = jax.device_put(np.zeros((4, 6), np.float32), s)
    assert x.addressable_shards[0].data.shape == (2, 3)
    # the same devices in the same order as the plain mesh: usable in one jit with it
    assert list(s.mesh.devices.flat) == list(mesh.devices.flat)
    plain = named_sharding(mesh, P("mp"))
    assert plain.mesh == mesh


def test_grouped_entries_parse_and_count_their_groups():
    assert parse("mp:2") == ("mp", 2)
    assert parse("mp") == ("mp", None)
    assert per_device_pieces(P(None, "mp:2"), {"dp": 2, "mp": 4}) == 2
    assert per_device_pieces(P("dp", "mp:2"), {"dp": 2, "mp": 4}) == 4
    pl = Placement(("k",), (32, 2, 4), np.float32, P(None, "mp:2"), "test")
    assert pl.bytes_per_device({"dp": 2, "mp": 4}) == 32 * 2 * 4 * 4 // 2


def test_a_user_rule_with_groups_that_do_not_divide_the_shards_is_refused():
    check_spec_fits(P(None, "mp:2"), (32, 2, 4), {"dp": 2, "mp": 4}, ("k",))
    with pytest.raises(ConfigError, match="'mp:3'.*mp:k"):
        check_spec_fits(P(None, "mp:3"), (32, 3, 4), {"dp": 2, "mp": 4}, ("k",))


def test_fsdp_stores_a_grouped_tensor_over_all_devices():
    pl = Placement(("k",), (64, 2, 4), np.float32, P(None, "mp:2"), "K/V heads")
    out, = fsdp_placements([pl], 2, n_model_shards=4)
    assert out.spec == P(("dp", "mp"))
    assert out.bytes_per_device({"dp": 2, "mp": 4}) == 64 * 2 * 4 * 4 // 8


def test_a_grouped_rule_pasted_back_places_the_parameter_by_groups():
    from redcoast.sharding import ShardingPlan

    mesh = _mesh(2, 4)
    params = {"k": np.zeros((16, 2, 4), np.float32), "q": np.zeros((16, 8, 4), np.float32)}
    plan = ShardingPlan(params, mesh, user_rules=[(("k",), P(None, "mp:2")), (("q",), P(None, "mp"))])
    assert "'mp:2'" in plan.table()
    assert "PartitionSpec(None, 'mp:2')" in plan.rules_source()
    k = jax.device_put(params["k"], plan.param_shardings()["k"])
    assert k.addressable_shards[0].data.shape == (16, 1, 4)
    assert plan.placements[0].bytes_per_device(dict(mesh.shape)) == 16 * 2 * 4 * 4 // 2
