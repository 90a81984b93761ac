"""The README's modern rows: Llama-3-8B and Llama-3-70B on 8 and 64 H100s (80 GB) at 4096 and
8192 tokens, fp32 and bf16 AdamW, FSDP (--model-shards 1) and tensor parallel (--model-shards 8,
the GPUs of a host) side by side, and the layout ``redcoast plan`` chooses by itself (model
shards, remat and scan searched) with its estimated step time and MFU; each figure from the
compiler named (``--target h100``: XLA:GPU through JAX's CUDA plugin, no GPU needed; run this
with a Python whose jax has ``jax[cuda12]`` at its version).

A pinned plan is run only when the chosen plan's search left the layouts with those model
shards unsettled (it stops at the first that fits), so a row costs one to three searches.

    python benchmarks/modern_rows.py [--models 8b 70b] [--devices 8 64] [--seq 4096 8192]
                                     [--dtypes float32 bfloat16] [--target h100] [--json out]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CONFIGS = {"8b": "llama-3-8b", "70b": "llama-3-70b"}
GPUS_A_HOST = 8


def plan(config, devices, seq, dtype, target, model_shards=None):
    """``(record, wall seconds)`` of ``redcoast plan`` in a process of its own, or
    ``(None, the error's last line)``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        command = [sys.executable, "-m", "redcoast", "plan",
                   os.path.join(ROOT, "benchmarks", "configs", config + ".json"),
                   "--devices", str(devices), "--hosts", str(max(1, devices // GPUS_A_HOST)),
                   "--device-memory", "80GiB", "--seq-len", str(seq), "--param-dtype", dtype,
                   "--target", target, "--json", out, "--quiet"]
        if model_shards:
            command += ["--model-shards", str(model_shards)]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env["PYTHONPATH"] = ROOT
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode:
            return None, (done.stderr.strip().splitlines() or ["failed"])[-1]
        with open(out) as f:
            return json.load(f), time.perf_counter() - start


def compiled_with(record, model_shards):
    """The compiled candidate of ``record``'s search with ``model_shards`` that fits, else the
    smallest compiled one, else None."""
    rows = [c for c in record["candidates"] if c["model_shards"] == model_shards and c["compiled"]]
    fits = [c for c in rows if c["status"] == "FITS"]
    return (fits or sorted(rows, key=lambda c: c["peak_bytes"]) or [None])[0]


def settled(record, model_shards):
    """Whether ``record``'s search settled the layouts with ``model_shards``: one fits, or each
    was compiled or ruled out (none left untried because a faster one fitted)."""
    rows = [c for c in record["candidates"] if c["model_shards"] == model_shards]
    return bool(rows) and (any(c["status"] == "FITS" for c in rows)
                           or not any(c["why"].startswith("estimated") for c in rows))


def side(record, model_shards):
    """One side of a row (FSDP or tensor parallel): its best compiled layout, peak, verdict."""
    c = compiled_with(record, model_shards)
    if c is None:
        why = next((x["why"] for x in record["candidates"] if x["model_shards"] == model_shards),
                   "not searched")
        return f"not compiled ({why[:40]})"
    flags = "+".join(f for f, on in (("remat", c["remat"]), ("scan", c["scan"])) if on) or "-"
    verdict = "FITS" if c["status"] == "FITS" else "DOES NOT FIT"
    return f"{c['peak_bytes'] / 2**30:.1f} GiB {verdict} ({flags}, {c['est_step_seconds']:.2f} s)"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--devices", nargs="*", type=int, default=[8, 64])
    p.add_argument("--seq", nargs="*", type=int, default=[4096, 8192])
    p.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    p.add_argument("--target", default="h100")
    p.add_argument("--json", help="append each row's records here (JSON lines)")
    args = p.parse_args()
    print(f"{'model':<12}{'GPUs':>5}{'seq':>6}{'dtype':>6}  {'FSDP (mp=1)':<40}"
          f"{'tensor parallel (mp=8)':<40}{'chosen':<28}{'est. step':>10}{'MFU':>5}"
          f"{'wall':>7}  compiler", flush=True)
    for model in args.models:
        for devices in args.devices:
            for seq in args.seq:
                for dtype in args.dtypes:
                    row(model, devices, seq, dtype, args)


def row(model, devices, seq, dtype, args):
    chosen, wall = plan(CONFIGS[model], devices, seq, dtype, args.target)
    if chosen is None:
        print(f"{model:<12}{devices:>5}{seq:>6}{dtype[:4]:>6}  {wall}", flush=True)
        return
    records = {"chosen": chosen}
    for name, shards in (("fsdp", 1), ("tp", GPUS_A_HOST)):
        if not settled(chosen, shards):
            records[name], seconds = plan(CONFIGS[model], devices, seq, dtype, args.target, shards)
            wall += seconds if records[name] else 0
        else:
            records[name] = chosen
    sides = [side(records[n], s) if records[n] else "failed" for n, s in (("fsdp", 1),
                                                                           ("tp", GPUS_A_HOST))]
    layout = chosen["layout"].split(",")[0] + (", remat" if chosen["remat"] else "") + (
        ", scan" if chosen["scan_layers"] else "")
    if not chosen["fits"]:
        layout = "none fits"
    mfu = f"{chosen['est_mfu']:.0%}" if chosen.get("est_mfu") is not None else "-"
    compiler = chosen["compiler"].split(" for ")[0]
    print(f"{model:<12}{devices:>5}{seq:>6}{dtype[:4]:>6}  {sides[0]:<40}{sides[1]:<40}"
          f"{layout:<28}{chosen['est_step_seconds']:>9.2f}s{mfu:>5}{wall:>6.0f}s  {compiler}",
          flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"model": model, "devices": devices, "seq": seq, "dtype": dtype,
                                **records}) + "\n")


if __name__ == "__main__":
    main()
