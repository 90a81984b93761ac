"""The collective parser on programs with a known number of collectives."""


import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from redcoast.layout.comms import collective_report, megatron_ideal, per_layer


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("dp", "mp"), axis_types=(AxisType.Auto,) * 2)


def compile_shard_map(mesh, body, in_specs, out_specs, *args):
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    return f.lower(*args).compile()


def test_each_kind_is_counted_with_its_bytes_and_axis(mesh):
    x = jnp.ones((8, 16), jnp.float32)  # per device (4, 4) under P('dp', 'mp')

    def body(a):
        s = jax.lax.psum(a, "mp")                                   # all-reduce over mp
        g = jax.lax.all_gather(a, "dp", tiled=True)                 # all-gather over dp
        r = jax.lax.psum_scatter(g, "dp", scatter_dimension=0, tiled=True)  # reduce-scatter over dp
        t = jax.lax.all_to_all(a, "mp", 0, 0, tiled=True)           # all-to-all over mp
        p = jax.lax.ppermute(a, "mp", [(i, (i + 1) % 4) for i in range(4)])  # collective-permute
        return s + r + t + p

    rep = collective_report(compile_shard_map(mesh, body, P("dp", "mp"), P("dp", "mp"), x), mesh)
    assert rep.by_kind() == {"all-reduce": (1, 64), "all-gather": (1, 128), "reduce-scatter": (1, 128),
                             "all-to-all": (1, 64), "collective-permute": (1, 64)}
    assert rep.count(axis="mp") == 3 and rep.count(axis="dp") == 2
    assert rep.wire_bytes("all-reduce") == pytest.approx(2 * 3 / 4 * 64)
    assert rep.wire_bytes("all-gather") == pytest.approx(1 / 2 * 128)


def test_collectives_in_loops_count_every_iteration(mesh):
    x = jnp.ones((8, 16), jnp.float32)

    def body(a):
        return jax.lax.fori_loop(0, 5, lambda i, c: c + jax.lax.psum(c, "mp") * 0.5, a)

    rep = collective_report(compile_shard_map(mesh, body, P("dp", "mp"), P("dp", "mp"), x), mesh)
    assert rep.count("all-reduce", "mp") == 5
    assert rep.bytes("all-reduce", "mp") == 5 * 64


def test_a_megatron_mlp_stack_moves_two_all_reduces_per_layer(mesh):
    b, t, h, f = 4, 8, 16, 32
    x = jnp.ones((b, t, h), jnp.float32)

    def compiled(n_layers):
        params = [{"up": jnp.ones((h, f)), "down": jnp.ones((f, h))} for _ in range(n_layers)]
        specs = [{"up": NamedSharding(mesh, P(None, "mp")), "down": NamedSharding(mesh, P("mp"))}
                 for _ in range(n_layers)]

        def loss(p, x):
            for lyr in p:
                x = x + jnp.tanh(x @ lyr["up"]) @ lyr["down"]
            return jnp.mean(x ** 2)

        return jax.jit(jax.grad(loss), in_shardings=(specs, NamedSharding(mesh, P("dp"))),
                       out_shardings=specs).lower(params, x).compile()

    layer = per_layer(compiled, mesh)
    act = (b // 2) * t * h * 4
    ideal = megatron_ideal(b // 2, t, h, 4)  # attention + MLP: 4 all-reduces per layer
    assert layer["mp"]["count"] == 2  # MLP only: one forward, one backward
    assert layer["mp"]["bytes"] == 2 * act
    assert layer["mp"]["wire_bytes"] == pytest.approx(ideal["wire_bytes"] / 2)
    assert ideal["count"] == 4 and megatron_ideal(1, 1, 1, 2, cross_attention=True)["count"] == 6
    # full activation recomputation runs the forward's all-reduces again in the backward
    assert megatron_ideal(1, 1, 1, 2, recompute=True)["count"] == 6
    assert megatron_ideal(1, 1, 1, 2, cross_attention=True, recompute=True)["count"] == 9


HLO = """HloModule m, entry_computation_layout={()->f32[]}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[2,8])) -> (s32[], f32[2,8]) {
  %ars = f32[2,8]{1,0} all-reduce-start(%v), channel_id=3, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %ard = f32[2,8]{1,0} all-reduce-done(%ars)
}

ENTRY %main () -> f32[] {
  %ar = (f32[4,16]{1,0}, bf16[8]{0}) all-reduce(%a, %b), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %ags = ((f32[2,4]{1,0}), (f32[2,16]{1,0})) all-gather-start(%c), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}, use_global_device_ids=true
  %agd = f32[2,16]{1,0} all-gather-done(%ags)
  %cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%d), channel_id=4, source_target_pairs={{0,4},{4,0}}
  %w = (s32[], f32[2,8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[1,8]{1,0} reduce-scatter(%e), channel_id=5, replica_groups=mesh['dp'=2,'mp'=4] {'mp'}, dimensions={0}, to_apply=%add
}
"""


def test_async_tuple_iota_and_mesh_forms_of_the_text():
    rep = collective_report(HLO, {"dp": 2, "mp": 4})
    kinds = {(c.op, c.axis, c.bytes, c.times) for c in rep.collectives}
    assert kinds == {
        ("all-reduce", "dp", 4 * 16 * 4 + 8 * 2, 1),       # variadic: tuple result, groups {0,4},{1,5}..
        ("all-gather-start", "mp", 2 * 16 * 4, 1),          # the gathered output, not the operand
        ("collective-permute-start", "dp", 8 * 4, 1),       # the operand, not the u32 contexts
        ("all-reduce-start", "mp", 2 * 8 * 4, 3),           # in a while body: runs 3 times
        ("reduce-scatter", "mp", 4 * 8 * 4, 1),             # the full input: result x group size
    }
    assert rep.count() == 7 and rep.count(axis="mp") == 5


def test_mesh_groups_with_permuted_device_ids():
    # newer XLA prints sub-axis groups over a permuted device order (seen with grouped-query K/V)
    from redcoast.layout.comms import _classify, _parse_groups
    line = ("%all-gather.5 = f32[32,2,4]{2,0,1} all-gather(%f), channel_id=73, replica_groups="
            "mesh['axis_0'=1,'axis_1'=2,'axis_2'=1,'axis_3'=4], device_ids=([2,2,2]T(1,0,2)) "
            "{'axis_1'}, dimensions={1}, use_global_device_ids=true")
    groups = _parse_groups(line)
    assert groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _classify(groups, {"dp": 2, "mp": 4}, "all-gather") == "mp"
    listed = line.replace("([2,2,2]T(1,0,2))", "(0,1,4,5,2,3,6,7)")  # the same order, listed
    assert _parse_groups(listed) == groups


def test_mesh_groups_over_redcoasts_grouped_axis_names():
    # jax 0.12 prints the mesh of a sharding over grouped axes with their own names, which hold
    # ':' and '/' (K/V kept by groups of shards: the 'mp' devices viewed as groups x within)
    from redcoast.layout.comms import _classify, _parse_groups
    mesh = "replica_groups=mesh['dp'=2,'mp:2'=2,'mp:2/within'=2] "
    line = ("%all-reduce.7 = f32[4,8]{1,0} all-reduce(%w), channel_id=15, " + mesh
            + "{GROUPS}, use_global_device_ids=true").replace
    both = _parse_groups(line("GROUPS", "'mp:2','mp:2/within'"))
    assert both == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _classify(both, {"dp": 2, "mp": 4}, "all-reduce") == "mp"
    assert _parse_groups(line("GROUPS", "'mp:2/within'")) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _parse_groups(line("GROUPS", "'mp:2'")) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_mesh_groups_over_shardys_sub_axes():
    # jax 0.11 and 0.12 print a collective over part of a mesh axis as a Shardy sub-axis,
    # 'mp':(2)2 = of 'mp' (4 = 2 x 2, major first) the factor of size 2 after one of size 2
    # (seen on a GQA Llama, 2 KV heads on 4 model shards; it stopped the layout choice with a
    # ValueError before this was parsed)
    from redcoast.layout.comms import _classify, _parse_groups
    line = ("%all-reduce.39 = (f32[2,16,1,8]{3,2,1,0}, f32[2,16,1,8]{3,2,1,0}) all-reduce("
            "%a, %b), channel_id=14, replica_groups=mesh['dp'=2,'mp'=4] {GROUPS}, "
            "use_global_device_ids=true, to_apply=%region_23.24.clone").replace
    minor = _parse_groups(line("GROUPS", "'mp':(2)2"))
    assert minor == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _classify(minor, {"dp": 2, "mp": 4}, "all-reduce") == "mp"
    assert _parse_groups(line("GROUPS", "'mp':(1)2")) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _parse_groups(line("GROUPS", "'mp'")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sorted(map(sorted, _parse_groups(line("GROUPS", "'dp', 'mp':(2)2")))) == \
        [[0, 1, 4, 5], [2, 3, 6, 7]]
    # an 8-wide axis in three factors: the middle one
    wide = line("GROUPS", "'mp':(2)2").replace("'dp'=2,'mp'=4", "'dp'=1,'mp'=8")
    assert _parse_groups(wide) == [[0, 2], [1, 3], [4, 6], [5, 7]]
