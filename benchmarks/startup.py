"""Time to the first update (issue 28): from ``Trainer(...)`` to the end of the first training
step, for the defaults on a first run and on a rerun with the same workdir (the chosen layout
remembered there), a fixed layout, and a hand-written ``jax.jit`` step; then the steady step.

Task B1 (benchmarks/defaults_vs_hand.py's Llama: hidden 256, 4 layers, sequence 128, AdamW,
global batch 16) on 8 simulated CPU devices. Each measurement is a fresh Python process (no
in-process compilation cache carries over); the four programs alternate, in rotated order,
``--repeats`` times; medians are printed, and each program's ratio to the hand-written one.
The first-run and fixed-layout programs get a fresh workdir and an empty per-user cache
(``REDCOAST_CACHE``: the remembered layouts and JAX's compiled programs) each time, the rerun
program the workdir and cache its own first run prepared (untimed); the hand-written step runs
without JAX's compilation cache, as a script does by default. Run from the repository root:

    python benchmarks/startup.py                 # about 5 minutes on 2 cores
    python benchmarks/startup.py --mesh 2x4 --repeats 5
    python benchmarks/startup.py --layers 2 --steps 3   # issue 28's 2-layer, 4-update run

The last column is a whole short run: the first update and ``--steps`` more.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAMS = ("defaults-first-run", "defaults-rerun", "fixed-layout", "hand-written")


def one(program, mesh, workdir, steps, layers):
    """In a fresh process: seconds from building the trainer (or the step) to the end of the
    first update, then the median of ``steps`` more; printed as JSON."""
    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, HERE)
    from redcoast.simulate import simulate_cpu_devices
    simulate_cpu_devices(8)
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import defaults_vs_hand as b1
    from redcoast import Deployer, Trainer

    dp, mp = (int(x) for x in mesh.split("x"))
    rng = np.random.default_rng(0)
    examples = [{"ids": rng.integers(0, b1.VOCAB, b1.SEQ + 1).astype(np.int32)}
                for _ in range(b1.GLOBAL_BATCH)]
    model, optimizer = b1.make_model(layers), optax.adamw(1e-3)
    params = jax.block_until_ready(model.init(0))
    per_device = b1.GLOBAL_BATCH // dp
    deployer = Deployer(n_model_shards=mp, verbose=False,
                        workdir=workdir if program.startswith("defaults") else None)
    start = time.perf_counter()
    if program == "hand-written":
        mesh_ = deployer.mesh
        plan = deployer.get_sharding_plan(model.abstract_params(), b1.HAND_RULES)
        param_sh = plan.param_shardings()
        placed = jax.device_put(params, param_sh)
        opt_sh = plan.opt_state_shardings(jax.eval_shape(optimizer.init, placed))
        state = (placed, jax.jit(optimizer.init, out_shardings=opt_sh)(placed))
        loss_fn = b1.lm_loss(model)

        def update(state, batch):
            p, o = state
            loss, grads = jax.value_and_grad(lambda q: loss_fn(None, None, q, batch, True))(p)
            updates, o = optimizer.update(grads, o, p)
            return (optax.apply_updates(p, updates), o), loss

        batch_sharding = NamedSharding(mesh_, P("dp"))
        step = jax.jit(update, in_shardings=((param_sh, opt_sh), batch_sharding),
                       out_shardings=((param_sh, opt_sh), NamedSharding(mesh_, P())),
                       donate_argnums=0)
        batch = jax.device_put(b1.collate(examples), batch_sharding)
        times = [None]
        state, loss = step(state, batch)
        jax.block_until_ready(loss)
        times[0] = time.perf_counter() - start
        for _ in range(steps):
            t0 = time.perf_counter()
            state, loss = step(state, batch)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - t0)
    else:
        options = dict(fsdp=False, fuse_matmuls=False) if program == "fixed-layout" else {}
        trainer = Trainer(deployer, b1.collate, model.apply, b1.lm_loss(model), params, optimizer,
                          **options)
        times, last = [], [start]

        def timing(*_):  # called by fit's metrics after each update: log_every_n_steps=1
            jax.block_until_ready(trainer._state.step)
            now = time.perf_counter()
            times.append(now - last[0])
            last[0] = now
        deployer.log_metrics = timing
        trainer.fit(examples * (steps + 1), per_device_batch_size=per_device, n_epochs=1,
                    log_every_n_steps=1, resume=False)
    print(json.dumps({"to_first_update_s": times[0], "step_s": statistics.median(times[1:])}))


def measure(program, mesh, workdir, steps, cache, layers):
    env = {**os.environ, "REDCOAST_CACHE": cache}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", program,
                          "--mesh", mesh, "--workdir", workdir, "--steps", str(steps),
                          "--layers", str(layers)],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"{program} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default="4x2", help="dp x mp")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="steady steps after the first")
    ap.add_argument("--layers", type=int, default=4, help="the model's layers (B1: 4)")
    ap.add_argument("--one", choices=PROGRAMS, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args.one, args.mesh, args.workdir, args.steps, args.layers)
    results = {p: [] for p in PROGRAMS}
    with tempfile.TemporaryDirectory() as scratch:
        remembered = os.path.join(scratch, "remembered")
        kept = os.path.join(scratch, "remembered-cache")
        measure("defaults-first-run", args.mesh, remembered, args.steps, kept, args.layers)  # the rerun's
        for r in range(args.repeats):
            order = PROGRAMS[r % 4:] + PROGRAMS[:r % 4]
            for program in order:
                fresh = os.path.join(scratch, f"{program}-{r}")
                workdir, cache = {"defaults-rerun": (remembered, kept),
                                  "hand-written": (fresh, "off")}.get(
                                      program, (fresh, fresh + "-cache"))
                results[program].append(measure(program, args.mesh, workdir, args.steps, cache,
                                                args.layers))
    def run_s(x):
        return x["to_first_update_s"] + args.steps * x["step_s"]

    hand = statistics.median(x["to_first_update_s"] for x in results["hand-written"])
    hand_step = statistics.median(x["step_s"] for x in results["hand-written"])
    fixed_run = statistics.median(run_s(x) for x in results["fixed-layout"])
    print(f"B1 ({args.layers} layers) on {args.mesh} (dp x mp), {args.repeats} alternating runs "
          "each; medians")
    print(f"{'program':>20} {'to 1st update s':>16} {'/ hand':>7} {'step ms':>8} {'/ hand':>7} "
          f"{f'{args.steps + 1} updates s':>13} {'/ fixed':>8}")
    for program in PROGRAMS:
        first = statistics.median(x["to_first_update_s"] for x in results[program])
        step = statistics.median(x["step_s"] for x in results[program])
        run = statistics.median(run_s(x) for x in results[program])
        print(f"{program:>20} {first:16.2f} {first / hand:7.2f} {step * 1e3:8.1f} "
              f"{step / hand_step:7.2f} {run:13.2f} {run / fixed_run:8.2f}")


if __name__ == "__main__":
    main()
