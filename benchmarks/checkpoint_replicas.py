"""Saving replicated arrays: in slices, one per device that holds them (Orbax's default), or whole
below redcoast's slice size (``redcoast.store.checkpoint.REPLICA_SLICE_MIN_BYTES``).

    python benchmarks/checkpoint_replicas.py [--repeats 5] [--large-mib 400]

On 8 simulated CPU devices (4 data shards x 2 model shards), two states, each saved (blocking,
until complete on disk) by a store of each kind in turns, so that machine noise hits both alike:
  - small: a tiny model's training state (params and adamw's two moments: 216 arrays of 64 to
    4096 floats, replicated on all 8 devices);
  - large: ``--large-mib`` of 2048 x 2048 float32 weights split over the 2 model shards and
    replicated over the 4 data shards (fsdp off): 8 MiB per device per array, 2 MiB slices.
It prints the median seconds per save and the ratio. One host writes every slice here; on
several hosts the slices of a replicated array are written by several hosts at once, which this
machine cannot show (what a slice costs, it can).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from redcoast.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import argparse  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from redcoast.store.checkpoint import REPLICA_SLICE_MIN_BYTES, CheckpointStore  # noqa: E402


def small_state(mesh):
    """72 arrays a copy (parameters, then two moments): a tiny model's state, replicated."""
    replicated = NamedSharding(mesh, P())
    shapes = [(64,), (64, 64), (64,), (64, 64)] * 18
    return {part: {f"w{i}": jax.device_put(jnp.full(s, i + k, jnp.float32), replicated)
                   for i, s in enumerate(shapes)}
            for k, part in enumerate(("params", "mu", "nu"))}


def large_state(mesh, mib):
    split = NamedSharding(mesh, P(None, "mp"))
    n = max(1, mib // 16)
    return {f"w{i}": jax.device_put(jnp.full((2048, 2048), i, jnp.float32), split)
            for i in range(n)}


def save_seconds(root, name, state, min_bytes):
    store = CheckpointStore(os.path.join(root, name), async_save=False,
                            replica_slice_min_bytes=min_bytes)
    start = time.perf_counter()
    store.save(1, state, {})
    store.wait()
    seconds = time.perf_counter() - start
    store.close()
    shutil.rmtree(os.path.join(root, name))
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--large-mib", type=int, default=400)
    args = parser.parse_args()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "mp"))
    kinds = {"orbax (every array in slices)": 0,
             f"redcoast (slices of >= {REPLICA_SLICE_MIN_BYTES >> 20} MiB)": None}
    print(f"jax {jax.__version__}; {jax.device_count()} x {jax.devices()[0].platform}, "
          "mesh 4 (dp) x 2 (mp)")
    root = tempfile.mkdtemp(prefix="redcoast-replicas-")
    try:
        for label, state in (("small", small_state(mesh)),
                             ("large", large_state(mesh, args.large_mib))):
            nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
            times = {kind: [] for kind in kinds}
            for kind, min_bytes in kinds.items():  # the first save of each compiles its slicing
                save_seconds(root, "warm", state, min_bytes)
            for r in range(args.repeats):
                for kind, min_bytes in kinds.items():
                    times[kind].append(save_seconds(root, f"{r}", state, min_bytes))
            holders = 8 if label == "small" else 4
            print(f"\n{label}: {len(jax.tree_util.tree_leaves(state))} arrays, "
                  f"{nbytes / 2**20:.1f} MiB (each byte held by {holders} devices)")
            medians = {kind: float(np.median(t)) for kind, t in times.items()}
            for kind, seconds in medians.items():
                print(f"  {kind:<36} {seconds:7.3f} s a save")
            orbax, ours = medians.values()
            print(f"  orbax / redcoast: {orbax / ours:.2f}x (medians of {args.repeats}, in turns)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
