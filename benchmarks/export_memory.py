"""Peak host memory of exporting parameters: redcoast's streamed export against gathering all.

A synthetic model of ``--size-gib`` GiB (tensors of ``--tensor-mib`` MiB, each split over 8
simulated CPU devices, as a sharded model is) is exported to a safetensors file by
  (a) stream: ``Deployer.export_params`` (redcoast now: one tensor gathered and written at a time);
  (b) gather: every tensor gathered to host memory first, then ``safetensors.numpy.save_file``
      (what redcoast did before, and what a hand-written export usually does).
Each measurement runs in a fresh process; the modes alternate (a, b, a, b, ...). On CPU the
model's device arrays are themselves host memory, so the figure that matters is the *extra*
memory the export takes: peak RSS during the export (VmHWM, reset just before it) minus the RSS
before it. Prints it per mode, as a fraction of the model's size, and the ratio between modes.

    python benchmarks/export_memory.py --size-gib 3 --repeats 2
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def child(mode, size_gib, tensor_mib, path):
    sys.path.insert(0, ROOT)
    from redcoast.simulate import simulate_cpu_devices
    simulate_cpu_devices(8)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from redcoast import Deployer
    from redcoast.export import flat_tensors

    deployer = Deployer(verbose=False)
    rows = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
    n_tensors = max(1, round(size_gib * 1024 / tensor_mib))
    cols = 1024
    n_rows = tensor_mib * 2**20 // 4 // cols // 8 * 8
    params = {}
    for i in range(n_tensors):  # built one at a time: the host copy is dropped at once
        host = np.full((n_rows, cols), i, np.float32)
        params[f"layer_{i:03d}"] = jax.device_put(host, rows)
        del host
    jax.block_until_ready(params)
    model_bytes = sum(x.nbytes for x in params.values())
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
    start = time.perf_counter()
    if mode == "stream":
        deployer.export_params(params, path)
    else:
        from safetensors.numpy import save_file
        save_file(flat_tensors(params), path)
    took = time.perf_counter() - start
    peak = _status("VmHWM")
    assert os.path.getsize(path) >= model_bytes
    print(json.dumps({"mode": mode, "model_bytes": model_bytes, "rss_before": before,
                      "peak": peak, "seconds": took}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gib", type=float, default=3.0)
    parser.add_argument("--tensor-mib", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="stream,gather")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.size_gib, args.tensor_mib, args.path)
    host_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    results = {m: [] for m in args.modes.split(",")}
    with tempfile.TemporaryDirectory(dir=os.environ.get("EXPORT_DIR")) as tmp:
        for _ in range(args.repeats):
            for mode in results:
                path = os.path.join(tmp, "model.safetensors")
                out = subprocess.run([sys.executable, __file__, "--child", mode, "--path", path,
                                      "--size-gib", str(args.size_gib),
                                      "--tensor-mib", str(args.tensor_mib)],
                                     capture_output=True, text=True, check=True)
                results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
                os.remove(path)
    gib = 2**30
    model = results[next(iter(results))][0]["model_bytes"]
    print(f"model {model / gib:.2f} GiB in tensors of {args.tensor_mib} MiB over 8 CPU devices; "
          f"host memory {host_bytes / gib:.1f} GiB; {args.repeats} runs per mode, alternating")
    extra = {}
    for mode, runs in results.items():
        extra[mode] = statistics.median(r["peak"] - r["rss_before"] for r in runs)
        peak = statistics.median(r["peak"] for r in runs)
        secs = statistics.median(r["seconds"] for r in runs)
        print(f"  {mode:7s} extra memory during export {extra[mode] / gib:6.2f} GiB = "
              f"{extra[mode] / model:.3f} x model; peak RSS {peak / gib:.2f} GiB "
              f"({peak / host_bytes:.1%} of host memory); {secs:.1f} s")
    if "stream" in extra and "gather" in extra:
        print(f"  extra memory gather / stream = {extra['gather'] / max(extra['stream'], 1):.1f}")


if __name__ == "__main__":
    main()
