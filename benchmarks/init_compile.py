"""How long a model's fresh parameters take to compile, with redcoast's init options and without.

    python benchmarks/init_compile.py --layers 22                 # TinyLlama-1.1B's shape
    python benchmarks/init_compile.py --layers 22 --without       # also without the options
    python benchmarks/init_compile.py --layers 22 --target h100   # XLA:GPU, no GPU needed
    python benchmarks/init_compile.py --tiny                      # CI: width 64, both ways

``Model.init`` is one jitted program. Without ``models/base.INIT_COMPILER_OPTIONS`` XLA:GPU's
multi-output fusion draws every parameter of one shape in one kernel, whose assembly time grows
faster than the depth (TinyLlama-1.1B: 164 s on an H200 against 25 s for its training step). The
script compiles the program on the devices here (or, with ``--target``, for a GPU described to
JAX's CUDA plugin, which must be installed at jax's version), prints the seconds, and runs both
programs on a 2-layer model of the same width to check they draw the same numbers (on real
devices only).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--without", action="store_true", help="also compile without the options")
    ap.add_argument("--target", default=None, help="a GPU target (h100, h200, ...): compile only")
    ap.add_argument("--tiny", action="store_true", help="width 64, 2 layers: a smoke run (CI)")
    args = ap.parse_args()
    if args.target:
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    import jax
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    from redcoast.models import Model, base
    from redcoast.models.llama import LlamaConfig, LlamaForCausalLM

    if args.target:
        from redcoast.cli.gpu_targets import compile_only_devices
        devices, what = compile_only_devices(args.target, 1, 1, jax.__version__)
        device = devices[0]
    else:
        device, what = jax.devices()[0], f"{jax.devices()[0].device_kind}"
    print(f"jax {jax.__version__}; compiling for {what}")

    width = (dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                  num_key_value_heads=2) if args.tiny else
             dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                  num_attention_heads=32, num_key_value_heads=4))
    if args.tiny:
        args.layers, args.without = 2, True

    def model(layers):
        return Model(LlamaForCausalLM, LlamaConfig(**width, num_hidden_layers=layers))

    def program(m, options):
        return m.init_program(0, SingleDeviceSharding(device), compiler_options=options)

    kinds = {"redcoast's options": base.INIT_COMPILER_OPTIONS}
    if args.without:
        kinds["without them"] = {}
    for name, options in kinds.items():
        t0 = time.perf_counter()
        program(model(args.layers), options).lower().compile()
        print(f"{args.layers} layers, {name}: compiled in {time.perf_counter() - t0:.1f} s",
              flush=True)
    if not args.target:
        small = model(2)
        drawn = [jax.tree_util.tree_leaves(program(small, o)()) for o in
                 (base.INIT_COMPILER_OPTIONS, {})]
        same = all(np.array_equal(a, b) for a, b in zip(*drawn))
        print(f"2 layers, the same numbers with and without the options: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
