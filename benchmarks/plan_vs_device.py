"""How close is a plan to the device it is for? One model trained on this machine's accelerator,
beside the plans ``redcoast plan`` makes for it without the accelerator.

    python benchmarks/plan_vs_device.py CONFIG --seq-len 1024 --per-device-batch-size 4 \\
        [--cpu-plan plan.json] [--gpu-target h100|auto]

For one device, fp32 parameters and AdamW (the plan's defaults), four peaks per device:

- the plan's on XLA:CPU, standing in for the target's compiler (``--cpu-plan``, a ``redcoast
  plan --devices 1 --json`` record made anywhere, else planned here in a subprocess on the CPU);
- the plan's by the GPU compiler for a described GPU (``--gpu-target``, e.g. h100: ``redcoast
  plan --target h100``, in a subprocess; needs JAX's CUDA plugin, no GPU);
- this device's compiler's: ``memory_analysis()`` of the same Trainer's step compiled here;
- the allocator's: ``peak_bytes_in_use`` after real training steps on real parameters.

Then the Trainer's memory check before the first step (``step_meter.require_fits``) is given a
batch 16 times larger, too large for the device: how long until it stops, and with what message.

Without an accelerator, ``--without-device`` plans the README's two H100 rows (GPT2-Large and
TinyLlama-1.1B, seq 1024 x 2) with ``--target h100`` here and prints each beside the figures the
H100's own compiler gave on the real GPU:

    python benchmarks/plan_vs_device.py --without-device
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", help="a Hugging Face config.json")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--per-device-batch-size", type=int, default=1)
    p.add_argument("--cpu-plan", help="the plan's record (redcoast plan --devices 1 --json)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--gpu-target", help="also plan for this described GPU (redcoast plan "
                   "--target, e.g. h100; 'auto': the one this device is) in a subprocess")
    p.add_argument("--without-device", action="store_true",
                   help="no accelerator: the README's H100 rows planned for --target h100 here, "
                   "beside the H100 compiler's measured figures")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    if not args.without_device and (args.config is None or args.seq_len is None):
        p.error("CONFIG and --seq-len, or --without-device")
    return args


def gib(n):
    return f"{n / 2**30:.2f} GiB"


def cpu_plan(args, device_memory):
    if args.cpu_plan:
        with open(args.cpu_plan) as f:
            return json.load(f)
    from redcoast.cli.plan_command import plan
    import dataclasses
    return dataclasses.asdict(plan(args.config, devices=1, device_memory=device_memory,
                                   seq_len=args.seq_len, remat=False, scan_layers=False,
                                   per_device_batch_size=args.per_device_batch_size))


def gpu_plan(config, target, seq_len, per_device_batch_size, device_memory):
    """``redcoast plan --target`` for one GPU in a subprocess: its record, or the reason none."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        done = subprocess.run(
            [sys.executable, "-m", "redcoast", "plan", config, "--devices", "1", "--device-memory",
             str(device_memory), "--seq-len", str(seq_len), "--per-device-batch-size",
             str(per_device_batch_size), "--no-remat", "--no-scan-layers", "--target", target,
             "--json", out,
             "--quiet"], capture_output=True, text=True,
            env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
        if done.returncode:
            return None, done.stderr.strip().splitlines()[-1]
        with open(out) as f:
            return json.load(f), None


# The README's H100 rows: the H100's own compiler on the real GPU (jax 0.11.2, fp32 AdamW, one
# device, seq x batch 1024 x 2; benchmarks/gpu_checks.sh), and XLA:CPU's plan of the same
H100_MEASURED = {"gpt2-large": {"h100_compiler_gib": 26.36, "xla_cpu_plan_gib": 35.71},
                 "tinyllama-1.1b": {"h100_compiler_gib": 23.38, "xla_cpu_plan_gib": 37.41}}


def without_device(args):
    """The README's H100 rows planned for a described H100 here, beside the H100's own figures."""
    import jax
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
    figures = {}
    print(f"plan --target h100 here (jax {jax.__version__}) against the H100's compiler on the "
          "real GPU (jax 0.11.2), seq 1024 x 2, fp32 AdamW, one device")
    print(f"{'model':<16}{'plan (XLA:GPU, no GPU)':>24}{'H100 compiler':>15}{'ratio':>8}"
          f"{'plan (XLA:CPU)':>16}{'compile':>9}")
    for name, measured in H100_MEASURED.items():
        record, why_not = gpu_plan(os.path.join(root, f"{name}.json"), "h100", 1024, 2, "80GiB")
        if record is None:
            print(f"{name:<16}  not planned: {why_not}")
            continue
        peak = record["per_device_peak_bytes"] / 2**30
        figures[name] = {**measured, "plan_h100_gib": peak, "compiler": record["compiler"],
                         "compile_s": record["compile_seconds"]}
        print(f"{name:<16}{peak:>20.2f} GiB{measured['h100_compiler_gib']:>11.2f} GiB"
              f"{peak / measured['h100_compiler_gib']:>7.3f}x{measured['xla_cpu_plan_gib']:>12.2f} GiB"
              f"{record['compile_seconds']:>7.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


def main():
    args = parse()
    if args.without_device:
        return without_device(args)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from redcoast import Deployer, Trainer
    from redcoast.errors import ConfigError
    from redcoast.models.pretrained import model_from_config
    from redcoast.cli.plan_command import _loss_for

    device = jax.devices()[0]
    deployer = Deployer(jax_seed=0, n_model_shards=1, verbose=False)
    budget = deployer.device_memory_budget()
    print(f"{device.device_kind}, jax {jax.__version__}, device memory {gib(budget)}")
    planned = cpu_plan(args, budget)
    if args.gpu_target == "auto":  # the described GPU that this device is, if any
        from redcoast.cli import gpu_targets
        args.gpu_target = next((name for name in gpu_targets.names() if gpu_targets.description(
            name)["device_kind"] == device.device_kind), None)
    gpu_planned, gpu_why_not = (None, "no --gpu-target (or none describes this device)") if (
        not args.gpu_target) else gpu_plan(args.config, args.gpu_target, args.seq_len,
                                           args.per_device_batch_size, budget)

    model, abstract = model_from_config(args.config)
    model_type = json.load(open(args.config))["model_type"]
    # constant weights: memory does not depend on the values, and the model's own random
    # initialiser compiled for 142 s on an H100 for TinyLlama-1.1B (Model.init, jax 0.11.2)
    params = jax.tree_util.tree_map(lambda a: jnp.full(a.shape, 0.01, a.dtype), abstract)
    vocab = model.config.vocab_size

    def collate(rows):
        ids = np.stack([r["ids"] for r in rows])
        return {"ids": ids, "mask": np.ones_like(ids[:, :-1]), "labels": ids}

    trainer = Trainer(deployer, collate, model.apply, _loss_for(model, model_type), params,
                      optax.adamw(1e-5), fsdp=True, fuse_matmuls=True)
    n_params = int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
    del params  # the Trainer holds the state; a copy kept here would count in the allocator's peak
    rows = args.per_device_batch_size
    ids = jax.ShapeDtypeStruct((rows, args.seq_len + 1), jnp.int32)
    abstract_batch = {"ids": ids, "mask": jax.ShapeDtypeStruct((rows, args.seq_len), jnp.int32),
                      "labels": ids}
    t0 = time.perf_counter()
    m = trainer.compile_train_step(abstract_batch).memory_analysis()
    compile_s = time.perf_counter() - t0
    compiler_peak = int(m.argument_size_in_bytes + m.output_size_in_bytes
                        - m.alias_size_in_bytes + m.temp_size_in_bytes)

    if compiler_peak > budget:
        print(f"this device's compiler needs {gib(compiler_peak)} of {gib(budget)}: "
              f"not run (the XLA:CPU plan said {gib(planned['per_device_peak_bytes'])})")
        return
    rng = np.random.default_rng(0)
    examples = [{"ids": row} for row in
                rng.integers(0, vocab, (rows * args.steps, args.seq_len + 1)).astype(np.int32)]
    t0 = time.perf_counter()
    trainer.train(examples, rows, shuffle=False)
    jax.block_until_ready(trainer.params)
    train_s = time.perf_counter() - t0
    stats = device.memory_stats() or {}
    measured = int(stats.get("peak_bytes_in_use", 0))

    figures = {
        "config": os.path.basename(args.config), "device": device.device_kind,
        "jax": jax.__version__, "seq_len": args.seq_len, "per_device_batch_size": rows,
        "n_params": n_params,
        "plan_cpu_peak_bytes": planned["per_device_peak_bytes"],
        "plan_cpu_compiler": planned["compiler"],
        "plan_gpu_peak_bytes": gpu_planned and gpu_planned["per_device_peak_bytes"],
        "plan_gpu_compiler": gpu_planned["compiler"] if gpu_planned else gpu_why_not,
        "device_compiler_peak_bytes": compiler_peak,
        "device_compiler_temp_bytes": int(m.temp_size_in_bytes),
        "allocator_peak_bytes": measured, "device_compile_s": compile_s,
        "train_s": train_s, "steps": args.steps}
    print(f"{figures['config']}: {figures['n_params'] / 1e9:.2f} B params, seq {args.seq_len}, "
          f"batch {rows}, fp32 AdamW, one {device.device_kind}")
    def ratio(n):  # no allocator statistics on CPU devices
        return f"{n / measured:.3f}x measured" if measured else "(no allocator peak here)"
    print(f"  plan (XLA:CPU stand-in)    {gib(figures['plan_cpu_peak_bytes']):>12}"
          f"  {ratio(figures['plan_cpu_peak_bytes'])}")
    if gpu_planned:
        print(f"  plan (--target {args.gpu_target})  {gib(gpu_planned['per_device_peak_bytes']):>12}"
              f"  {ratio(gpu_planned['per_device_peak_bytes'])}")
    else:
        print(f"  plan (--target): {gpu_why_not}")
    print(f"  this device's compiler     {gib(compiler_peak):>12}"
          f"  {ratio(compiler_peak)}   (compiled in {compile_s:.0f} s)")
    print(f"  allocator peak, {args.steps} steps   {gib(measured):>12}")

    # the check before the first step, on a batch that cannot fit
    big = rows * 16
    examples = [{"ids": row} for row in
                rng.integers(0, vocab, (big, args.seq_len + 1)).astype(np.int32)]
    t0 = time.perf_counter()
    try:
        trainer.train(examples, big, shuffle=False)
        figures["too_large_batch"] = "trained: the check did not stop it"
    except ConfigError as e:
        figures["too_large_batch"] = str(e)
    figures["too_large_batch_s"] = time.perf_counter() - t0
    print(f"batch {big} per device: stopped after {figures['too_large_batch_s']:.1f} s:\n"
          f"{figures['too_large_batch']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
