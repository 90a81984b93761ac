"""Checkpoint cost for a model of ~100M+ parameters: save, restore, and training time lost.

    python benchmarks/checkpoint.py [--width 2048] [--layers 24] [--steps 8]

On 8 simulated CPU devices (by default dp=1 x mp=8, so no device repeats another's optimizer
work on these 2 cores) it trains a stack of dense layers with adamw through the
Trainer and measures, in one run:
  - a blocking save (Orbax, synchronous) and an asynchronous one: the time the training loop is
    held up, and the time until the checkpoint is complete on disk;
  - restoring the newest checkpoint onto the same mesh;
  - the training time lost to one save in the middle of ``--steps`` updates: (time with a save) -
    (time without), for blocking and for asynchronous saving.
The state saved is parameters + adamw's two moments (3 x 4 bytes per parameter).
"""

import os

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from redcoast.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import argparse  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from redcoast import Deployer, Trainer  # noqa: E402
from redcoast.store.checkpoint import CheckpointStore  # noqa: E402


class DenseStack(nn.Module):
    width: int
    layers: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers // 2):  # pairs: column- then row-parallel
            x = x + nn.Dense(self.width)(nn.relu(nn.Dense(self.width)(x)))
        return x


def collate(examples):
    return {"x": np.stack(examples)}


def loss(rng, state, params, batch, is_training):
    return jnp.mean(state.apply_fn({"params": params}, batch["x"]) ** 2)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - start, out


def run_steps(trainer, examples, n_steps, save_at=None, store=None):
    """Wall time of ``n_steps`` updates, saving once after update ``save_at``.

    The clock stops when the last update is done, not when the save is: an asynchronous save
    costs training only what it holds the loop up plus what its writing slows the steps down.
    """
    def after_step(position):
        if position == save_at and store is not None:
            trainer.save_checkpoint(store, 0, position)
        return position >= n_steps

    start = time.perf_counter()
    trainer.train(examples, 1, shuffle=False, log_every_n_steps=n_steps, after_step=after_step)
    jax.block_until_ready(trainer.state.params)
    elapsed = time.perf_counter() - start
    if store is not None:
        store.wait()
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-shards", type=int, default=8)
    args = parser.parse_args()

    model = DenseStack(args.width, args.layers)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, args.width)))["params"]
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    deployer = Deployer(n_model_shards=args.model_shards, verbose=False)
    trainer = Trainer(deployer, collate, model.apply, loss, params, optax.adamw(1e-4))
    rs = np.random.RandomState(0)
    examples = [rs.randn(args.width).astype(np.float32)
                for _ in range(deployer.n_data_shards * (args.steps + 1))]
    state_bytes = 3 * 4 * n_params
    print(f"jax {jax.__version__}; {jax.device_count()} x {jax.devices()[0].platform}; mesh "
          f"dp={deployer.n_data_shards} x mp={deployer.n_model_shards}")
    print(f"model: {args.layers} dense layers of {args.width}: {n_params / 1e6:.1f} M parameters; "
          f"checkpointed state (params + adamw moments) {state_bytes / 2**30:.2f} GiB")

    root = tempfile.mkdtemp(prefix="redcoast-ckpt-bench-")
    try:
        run_steps(trainer, examples, 2)  # compile and warm up
        rows = []
        for mode in ("blocking", "async"):
            store = CheckpointStore(os.path.join(root, mode), async_save=(mode == "async"))
            held, _ = timed(lambda: trainer.save_checkpoint(store, 0, 0))
            done, _ = timed(store.wait)
            rows.append((f"save ({mode}): loop held up", held))
            rows.append((f"save ({mode}): until complete on disk", held + done))
            store.close()
        store = CheckpointStore(os.path.join(root, "async"))
        restore, _ = timed(lambda: trainer.restore_checkpoint(store))
        rows.append(("restore (same mesh)", restore))
        store.close()

        # (no save, blocking, async) in turns, so machine noise hits all three alike
        times = {"none": [], "blocking": [], "async": []}
        for r in range(args.repeats):
            for mode in times:
                store = None if mode == "none" else CheckpointStore(
                    os.path.join(root, f"during-{mode}-{r}"), async_save=(mode == "async"))
                times[mode].append(run_steps(trainer, examples, args.steps,
                                             save_at=2, store=store))
                if store is not None:
                    store.close()
        base = float(np.median(times["none"]))
        lost = {mode: float(np.median(np.subtract(times[mode], times["none"])))
                for mode in ("blocking", "async")}
        per_step = base / args.steps
        print()
        for name, seconds in rows:
            print(f"  {name:<42} {seconds:8.2f} s   {state_bytes / seconds / 2**30:6.2f} GiB/s")
        print(f"  {'training step (no save)':<42} {per_step:8.2f} s")
        for mode, seconds in lost.items():
            print(f"  {'training time lost to one ' + mode + ' save':<42} {seconds:8.2f} s   "
                  f"({seconds / per_step:.1f} steps)")
        print(f"\n  medians of {args.repeats} paired repeats of {args.steps} updates; "
              f"async / blocking time lost: {lost['async'] / lost['blocking']:.2f}"
              if lost["blocking"] > 0 else "")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
