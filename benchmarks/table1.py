"""The paper's Table 1 ("runnable model finetuning on different servers", fp32 AdamW at the
longest training length shown), planned with ``redcoast plan`` on this CPU-only machine: the
model from its config.json (benchmarks/configs, from the public model cards), the layout the
Trainer chooses (tensor parallel within a host, FSDP across), the training step compiled for the
server's device count on simulated devices, its per-device peak against the device's memory.
Plus OPT-66B on 4 x A100 (should not fit) and Figure 3's OPT-2.7B on 4 x A100. The TPU rows
are compiled by the TPU compiler itself (``--target tpu-v4``) where libtpu is installed
(``pip install "jax[tpu]==<your jax>"``; no TPU needed), the A100 rows by the GPU compiler
(``--target a100-40gb``) where JAX's CUDA plugin is (``jax[cuda12]``; no GPU needed), else on
simulated CPU devices; the compiler column says which. No flag beyond the target: the plan
searches the model shards, remat and scanned layers itself and says what it chose.

    python benchmarks/table1.py [--rows NAME ...] [--param-dtype bfloat16] [--cpu-only]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

COMPILERS = {"cpu": "XLA:CPU", "tpu-v4": "TPU"}
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CONFIGS = os.path.join(ROOT, "benchmarks", "configs")

# name: (config, devices, hosts, memory per device, sequence length, the server in the paper)
ROWS = {
    "bart-large": ("bart-large", 2, 1, "10GiB", 1024, "2 x 1080Ti"),
    "gpt2-large": ("gpt2-large", 2, 1, "10GiB", 512, "2 x 1080Ti"),
    "llama-7b": ("llama-7b", 4, 1, "40GiB", 1024, "4 x A100"),
    "gpt-j-6b": ("gpt-j-6b", 4, 1, "40GiB", 1024, "4 x A100"),
    "t5-xxl": ("t5-v1_1-xxl", 8, 2, "32GiB", 512, "2 hosts x 4 TPU-v4"),
    "opt-13b": ("opt-13b", 8, 2, "32GiB", 1024, "2 hosts x 4 TPU-v4"),
    "opt-66b": ("opt-66b", 64, 16, "32GiB", 512, "16 hosts x 4 TPU-v4"),
    "opt-66b-on-4xA100": ("opt-66b", 4, 1, "40GiB", 512, "4 x A100 (not in the paper: too small)"),
    "opt-2.7b": ("opt-2.7b", 4, 1, "40GiB", 1024, "4 x A100 (Figure 3)"),
    # not in the paper: 80 layers, where compiling every layer unrolled takes minutes
    "llama-2-70b": ("llama-2-70b", 64, 16, "32GiB", 4096, "16 hosts x 4 TPU-v4 (80 layers)"),
}


def installed(package):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def target_of(name, cpu_only):
    """The TPU compiler for the TPU servers' rows and the GPU compiler for the A100 rows where
    they are installed, else simulated CPUs."""
    import jax
    server = ROWS[name][5]
    if cpu_only:
        return "cpu"
    if "TPU" in server and installed("libtpu"):
        return "tpu-v4"
    if "A100" in server and jax.__version__ in (installed("jax-cuda12-plugin"),
                                                installed("jax-cuda13-plugin")):
        return "a100-40gb"
    return "cpu"


def plan_row(name, param_dtype, target):
    config, devices, hosts, memory, seq, _ = ROWS[name]
    return plan_config(os.path.join(CONFIGS, config + ".json"), devices, hosts, memory, seq,
                       param_dtype, target)


def plan_config(config_file, devices, hosts, memory, seq, param_dtype, target):
    """``(record, seconds)``: ``redcoast plan`` of ``config_file`` in a process of its own (the
    device count is fixed when JAX starts, and host memory is measured per plan)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env["PYTHONPATH"] = ROOT
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "redcoast", "plan", config_file,
             "--devices", str(devices), "--hosts", str(hosts), "--device-memory", memory,
             "--seq-len", str(seq), "--param-dtype", param_dtype, "--target", target,
             "--json", out, "--quiet"],
            capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{config_file}: {done.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f), seconds


def compiled(record):
    """How many layouts the plan's search compiled for the row."""
    return sum(1 for c in record.get("candidates", []) if c["compiled"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=[r for r in ROWS if r != "llama-2-70b"],
                        choices=list(ROWS), help="default: the paper's rows (llama-2-70b on "
                        "request)")
    parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cpu-only", action="store_true",
                        help="simulated CPU devices for every row, even where libtpu is installed")
    args = parser.parse_args()
    gib = lambda n: f"{n / 2**30:.1f}"  # noqa: E731
    print(f"{'row':<19}{'server':<24}{'params':>8}{'seq':>6}  {'layout':<40}{'state/dev':>10}"
          f"{'peak/dev':>9}{'memory':>8}  {'verdict':<13}{'remat':<6}{'scan':<5}{'compiler':<10}"
          f"{'compile':>8}{'wall':>7}{'host':>6}{'tried':>6}")
    for name in args.rows:
        target = target_of(name, args.cpu_only)
        r, seconds = plan_row(name, args.param_dtype, target)
        state = r["params_bytes"] + r["optimizer_bytes"] + r["gradient_bytes"]
        layout = r["layout"].split(",")[0] + ("" if r["compile_seconds"] else " (not compiled)")
        if r.get("est_step_seconds"):
            layout += f", est. {r['est_step_seconds']:.2f} s"
        print(f"{name:<19}{ROWS[name][5]:<24}{r['n_params'] / 1e9:>7.2f}B{r['seq_len']:>6}  "
              f"{layout:<40}{gib(state):>10}{gib(r['per_device_peak_bytes']):>9}"
              f"{gib(r['device_memory_bytes']):>8}  {'FITS' if r['fits'] else 'DOES NOT FIT':<13}"
              f"{'yes' if r['remat'] else 'no':<6}{'yes' if r.get('scan_layers') else 'no':<5}"
              f"{COMPILERS.get(target, 'XLA:GPU'):<10}"
              f"{r['compile_seconds']:>7.0f}s{seconds:>6.0f}s"
              f"{gib(r['host_memory_bytes']):>6}{compiled(r):>6}", flush=True)
        for s in r["suggestions"]:
            print(f"{'':<19}suggestion: {s}")
    print("GiB per device; state = parameters + optimizer state + gradients as the layout places "
          "them; peak = the compiler's memory analysis of the compiled step (arguments + "
          "outputs - donated + temporaries): the TPU compiler's (libtpu), the GPU compiler's "
          "(XLA:GPU) or XLA:CPU's standing in; layout, remat and scan: the plan's choice (the "
          "fastest by estimate that fits); host = this machine's peak memory while planning "
          "the row.")


if __name__ == "__main__":
    main()
