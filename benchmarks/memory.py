"""Per-device parameter and optimizer-state memory: tensor parallelism alone vs with FSDP.

For every test architecture (tests/architectures.py) and 2, 4, 8 model shards on 8 simulated CPU
devices: place the parameters by the data-flow plan, create adamw's state with the plan's
shardings, and measure the live arrays (bytes of each array's shard on device 0).

- 'mp only / ideal': parameter bytes per device over (bytes of the tensors the plan splits /
  n_model_shards + bytes of those it replicates; K/V kept by groups of shards / groups); 1.00
  means every split is even.
- 'state / (total/8)': parameter + optimizer-state bytes per device over their total / 8, without
  and with FSDP on every tensor (``fsdp=True``'s plan; the Trainer's default weighs each
  tensor's gather against the step's time, redcoast/layout/fsdp_cost.py).
  Tensors the plan replicates over the model shards are split over dp and mp together.
  With mp = 8 there is one data shard, so FSDP changes nothing.

    python benchmarks/memory.py [architecture ...]
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from architectures import ARCHITECTURES  # noqa: E402
from redcoast.sharding import ShardingPlan  # noqa: E402
from redcoast.sharding.dataflow import dataflow_placements  # noqa: E402
from redcoast.sharding.fsdp import fsdp_placements  # noqa: E402

OPTIMIZER = optax.adamw(1e-3)


def per_device(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(tree))


def total(tree):
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def live_state(plan, params):
    """Parameters and adamw state placed by ``plan``, as live arrays."""
    params = jax.device_put(params, plan.param_shardings())
    opt_shardings = plan.opt_state_shardings(jax.eval_shape(OPTIMIZER.init, params))
    return params, jax.jit(OPTIMIZER.init, out_shardings=opt_shardings)(params)


def measure(name, n):
    arch = ARCHITECTURES[name]()
    mesh = jax.make_mesh((8 // n, n), ("dp", "mp"), axis_types=(AxisType.Auto,) * 2)
    mp = dataflow_placements(arch.loss, arch.params, arch.batch, n_model_shards=n)
    nbytes = lambda pl: int(np.prod(pl.shape, dtype=np.int64)) * np.dtype(pl.dtype).itemsize
    split = sum(nbytes(pl) for pl in mp if len(pl.spec))
    replicated = sum(nbytes(pl) for pl in mp if not len(pl.spec))
    # K/V kept by groups of shards (fewer heads than shards) can be split no further than groups
    ideal = sum(pl.bytes_per_device({"mp": n}) for pl in mp)

    params, opt = live_state(ShardingPlan(arch.params, mesh, base_placements=mp), arch.params)
    mp_ratio = per_device(params) / ideal
    mp_state = per_device((params, opt)) / (total((params, opt)) / 8)

    fsdp = fsdp_placements(mp, 8 // n, n_model_shards=n)
    params, opt = live_state(ShardingPlan(arch.params, mesh, base_placements=fsdp), arch.params)
    fsdp_state = per_device((params, opt)) / (total((params, opt)) / 8)
    return {"replicated": replicated / (split + replicated), "mp_ratio": mp_ratio,
            "mp_state": mp_state, "fsdp_state": fsdp_state, "total": total((params, opt))}


def main(names):
    print(f"{'architecture':<16}{'mp':>3}{'dp':>3}  {'replicated':>10}  {'mp only / ideal':>15}"
          f"  {'state/(total/8): mp only':>24}  {'with FSDP':>9}  {'params+adamw bytes':>18}")
    t0 = time.perf_counter()
    for name in names:
        for n in (2, 4, 8):
            r = measure(name, n)
            print(f"{name:<16}{n:>3}{8 // n:>3}  {r['replicated']:>9.1%}  {r['mp_ratio']:>15.2f}"
                  f"  {r['mp_state']:>24.2f}  {r['fsdp_state']:>9.2f}  {r['total']:>18,}", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s; jax {jax.__version__}, {jax.device_count()} CPU devices)")


if __name__ == "__main__":
    main(sys.argv[1:] or list(ARCHITECTURES))
