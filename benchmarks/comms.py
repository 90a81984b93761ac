"""Per-layer model-parallel traffic of the data-flow plan vs Megatron-LM's hand-written plan.

For every test architecture (tests/architectures.py) and 2, 4, 8 model shards on 8 simulated CPU
devices: derive the plan with ``dataflow_placements``, compile one SGD training step at two
depths, and difference their collectives (redcoast/layout/comms.py) to get one layer's traffic. The ratio
is per-layer 'mp' wire bytes over Megatron's (2 all-reduces of the [batch, seq, hidden] activation
forward and 2 backward; 3 + 3 with cross-attention; for layers under jax.checkpoint, as with
Megatron's full activation recomputation, the forward's all-reduces once more). Data-parallel
gradient reduction ('dp') and collectives spanning both axes ('all'/'mixed') are shown apart. The 'fused' column runs the same
plan with ``fuse_sibling_matmuls`` (matmuls sharing an input stacked into one, so the backward pass
sums their input gradients locally and all-reduces once; an MoE's expert outputs summed with
their gates before the all-reduce).

    python benchmarks/comms.py [architecture ...]
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import jax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from architectures import ARCHITECTURES, B  # noqa: E402
from redcoast.layout.comms import megatron_ideal, per_layer  # noqa: E402
from redcoast.sharding.dataflow import dataflow_placements  # noqa: E402
from redcoast.sharding.fusion import fuse_sibling_matmuls  # noqa: E402
from redcoast.sharding.grouped_axes import named_sharding  # noqa: E402
from redcoast.sharding.paths import path_to_tuple  # noqa: E402
from redcoast.sharding.rewrite_plan import RewritePlan  # noqa: E402


def compiled_step(arch, n, mesh, fuse=False):
    # as the Trainer: K/V kept by groups of shards only with their projection rewritten (fused)
    placements = dataflow_placements(arch.loss, arch.params, arch.batch, n_model_shards=n, group_kv_heads=fuse)
    by_path = {pl.path: pl.spec for pl in placements}
    shardings = jax.tree_util.tree_map_with_path(
        lambda kp, _: named_sharding(mesh, by_path[path_to_tuple(kp)]), arch.params)

    loss = fuse_sibling_matmuls(arch.loss, RewritePlan.from_placements(placements, mesh)) if fuse else arch.loss

    def step(params, batch):
        grads = jax.grad(loss)(params, batch)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    return jax.jit(step, in_shardings=(shardings, NamedSharding(mesh, P("dp"))),
                   out_shardings=shardings).lower(arch.params, arch.batch).compile()


def measure(name, n, fuse=False):
    mesh = jax.make_mesh((8 // n, n), ("dp", "mp"), axis_types=(AxisType.Auto,) * 2)
    layer = per_layer(lambda depth: compiled_step(ARCHITECTURES[name](n_layers=depth), n, mesh, fuse), mesh)
    arch = ARCHITECTURES[name]()
    ideal = megatron_ideal(B // (8 // n), arch.seq, arch.hidden, n, cross_attention=arch.cross_attention,
                           recompute=arch.recompute)
    get = lambda axis, key: layer.get(axis, {}).get(key, 0)
    if fuse:
        return {"mp_ratio": get("mp", "wire_bytes") / ideal["wire_bytes"], "mp_count": get("mp", "count")}
    return {"mp_count": get("mp", "count"), "ideal_count": ideal["count"],
            "mp_ratio": get("mp", "wire_bytes") / ideal["wire_bytes"],
            "dp_bytes": get("dp", "bytes"), "both_bytes": get("all", "bytes") + get("mixed", "bytes")}


def main(names):
    print("mp bytes / Megatron: per-layer model-parallel wire bytes over Megatron-LM's; 'placement'")
    print("runs the user's function as written, 'fused' through fuse_sibling_matmuls.")
    print(f"{'architecture':<21}{'mp':>3}  {'mp collectives/layer':>21}  {'placement':>10}  {'fused':>6}"
          f"  {'dp bytes/layer':>15}  {'dp+mp bytes/layer':>18}")
    t0 = time.perf_counter()
    for name in names:
        for n in (2, 4, 8):
            r = measure(name, n)
            f = measure(name, n, fuse=True)
            label = name + (" (remat)" if ARCHITECTURES[name]().recompute else "")
            print(f"{label:<21}{n:>3}  {r['mp_count']:>10g} (ideal {r['ideal_count']})  {r['mp_ratio']:>9.3f}x"
                  f"  {f['mp_ratio']:>5.3f}x  {r['dp_bytes']:>15,.0f}  {r['both_bytes']:>18,.0f}", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s; jax {jax.__version__}, {jax.device_count()} CPU devices)")


if __name__ == "__main__":
    main(sys.argv[1:] or list(ARCHITECTURES))
