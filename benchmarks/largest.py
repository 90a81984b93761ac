"""The largest model each of Table 1's servers could train, planned with ``redcoast plan``.

For each server of the paper's Table 1 (its devices, hosts, device memory, and the length of the
largest model the paper ran there) a Llama of a fixed width (a real config from
benchmarks/configs) is planned with more and more layers, stacked and scanned, fp32 AdamW (or
``--param-dtype bfloat16``), batch 1 per data shard, until one more layer would not fit: the
largest model of that width the server can train, against the paper's largest there.

The search costs few compilations: the training state grows by the same bytes per layer (two
plans deep enough to be refused from their state alone, without compiling, give that slope and
the deepest model whose state fits), so each compiled plan's margin under or over the device's
memory, in those bytes, says how many layers to add or drop; a guess outside the depths known
to fit and not to fit is replaced by the one halfway between. A plan that does not fit is tried
again with each layer rematerialised (``redcoast plan``'s own rule), so the answer may need remat.

    python benchmarks/largest.py [--servers NAME ...] [--param-dtype bfloat16] [--cpu-only]
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time

from table1 import CONFIGS, ROWS, has_libtpu, plan_config

# server: (the Table 1 row whose server and length it takes, the Llama config whose width is kept)
SERVERS = {
    "2 x 1080Ti": ("gpt2-large", "tinyllama-1.1b"),
    "4 x A100": ("llama-7b", "llama-7b"),
    "2 hosts x 4 TPU-v4": ("opt-13b", "llama-7b"),
    "16 hosts x 4 TPU-v4": ("opt-66b", "llama-2-70b"),
}
REFUSED_DEPTH = 1000  # deep enough that any server's state is refused without compiling


class Search:
    """Plans of one width at several depths on one server, each planned once."""

    def __init__(self, server, param_dtype, cpu_only):
        row, base = SERVERS[server]
        _, self.devices, self.hosts, self.memory, self.seq, _ = ROWS[row]
        self.paper_row = row
        with open(os.path.join(CONFIGS, base + ".json")) as f:
            self.config = json.load(f)
        self.base = base
        self.param_dtype = param_dtype
        self.target = "tpu-v4" if "TPU" in server and not cpu_only and has_libtpu() else "cpu"
        self.records = {}
        self.compiled = 0

    def at(self, n_layers):
        """The plan record of the model with ``n_layers`` layers."""
        if n_layers not in self.records:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "config.json")
                with open(path, "w") as f:
                    json.dump(dict(self.config, num_hidden_layers=n_layers), f)
                record, _ = plan_config(path, self.devices, self.hosts, self.memory, self.seq,
                                        self.param_dtype, self.target, scan_layers=True)
            self.compiled += record["compile_seconds"] > 0
            self.records[n_layers] = record
            print(f"  {n_layers} layers: {'FITS' if record['fits'] else 'does not fit'}, peak "
                  f"{record['per_device_peak_bytes'] / 2**30:.1f} GiB"
                  + (f" ({record['compile_seconds']:.0f} s compiling)" if record["compile_seconds"]
                     else " (the state alone, not compiled)"), file=sys.stderr, flush=True)
        return self.records[n_layers]

    def largest(self):
        """``n``: the most layers that fit (0 if one layer does not); n + 1 has been planned."""
        def state(r):
            return r["params_bytes"] + r["optimizer_bytes"] + r["gradient_bytes"]
        deep, deeper = self.at(REFUSED_DEPTH), self.at(2 * REFUSED_DEPTH)
        assert not deep["compile_seconds"], "raise REFUSED_DEPTH: its state fits this server"
        per_layer = (state(deeper) - state(deep)) / REFUSED_DEPTH
        memory = deep["device_memory_bytes"]
        fit = 0  # the most layers known to fit, and the fewest known not to
        unfit = max(1, math.floor(REFUSED_DEPTH - (state(deep) - memory) / per_layer) + 1)
        assert not self.at(unfit)["fits"], "the state bound is off by a layer"
        n = unfit - 1
        while unfit - fit > 1:
            r = self.at(n)
            if r["fits"]:
                fit = n
            else:
                unfit = n
            # the next depth from the bytes this one is under or over by, or halfway between
            margin = (memory - r["per_device_peak_bytes"]) / per_layer
            n = n + math.floor(margin) if margin >= 0 else n - math.ceil(-margin)
            if not fit < n < unfit:
                n = (fit + unfit) // 2
        return fit


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", nargs="*", default=list(SERVERS), choices=list(SERVERS))
    parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cpu-only", action="store_true",
                        help="simulated CPU devices for every server, even where libtpu is installed")
    args = parser.parse_args()
    gib = lambda n: f"{n / 2**30:.1f}"  # noqa: E731
    print(f"{'server':<21}{'width of':<16}{'seq':>5}  {'largest':>8}{'params':>9}{'peak/dev':>9}"
          f"{'memory':>8}  {'remat':<6}{'next layer':>11}  {'paper largest':<22}{'compiler':<9}"
          f"{'compiled':>9}{'wall':>7}")
    for server in args.servers:
        search = Search(server, args.param_dtype, args.cpu_only)
        start = time.perf_counter()
        n = search.largest()
        wall = time.perf_counter() - start
        best, nxt = search.records.get(n), search.records[n + 1]
        print(f"{server:<21}{search.base:<16}{search.seq:>5}  "
              + (f"{n:>3} layers{best['n_params'] / 1e9:>8.2f}B{gib(best['per_device_peak_bytes']):>9}"
                 f"{gib(best['device_memory_bytes']):>8}  {'yes' if best['remat'] else 'no':<6}"
                 if best else f"{'none':>8}{'':>9}{'':>9}{gib(nxt['device_memory_bytes']):>8}  {'':<6}")
              + f"{gib(nxt['per_device_peak_bytes']):>11}  {search.paper_row:<22}"
              f"{'TPU' if search.target != 'cpu' else 'XLA:CPU':<9}{search.compiled:>9}{wall:>6.0f}s",
              flush=True)
    print("GiB per device; a Llama of the named config's width (hidden, heads, MLP, vocabulary) "
          "with its layers stacked and scanned; largest = the most layers whose step FITS; next "
          "layer = the peak with one layer more (or its state alone, where that is refused "
          "without compiling); compiled = plans compiled in the search.")


if __name__ == "__main__":
    main()
