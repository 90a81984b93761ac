"""The share of a compiled CPU program's matrix-product FLOPs that XLA:CPU runs slowly: 16-bit
floating-point dots outside YNNPACK.

XLA:CPU (jax 0.10 to 0.12) hands a dot to YNNPACK (a ``__ynn_fusion``) only when its left
operand contracts its trailing dimensions in row-major layout: XLA does not yet emit the
transposes that would make the other dots eligible (``IsDotSupportedByYnn`` in XLA's
``xla/backends/cpu/ynn_support.cc``). Every other dot runs in Eigen. For float32 that costs
little (Eigen's float32 GEMM is about as fast as YNNPACK's on these CPUs), and jax 0.10
multiplies bfloat16 in float32 anyway; jax 0.12 keeps bfloat16 dots in bfloat16, and Eigen's
bfloat16 GEMM is several times slower than either. A weight gradient (activations^T x output
gradients) contracts over the tokens, so whether it runs fast depends on which operand XLA's
layout assignment transposes, which differs between programs of the same model: B2
(real_size.py) prints this share for each program so that a step-time gap on CPU can be told
apart from a gap in the program itself.

    python benchmarks/xla_cpu_dots.py program.hlo     # the text of compiled.as_text()
"""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from redcoast.layout.comms import hlo_computations, hlo_multiplicities  # noqa: E402

_DEFINITION = re.compile(r"%([\w.\-]+) = (\w+)\[([0-9,]*)\]")
_NARROW = {"bf16", "f16"}
_DOT = re.compile(r"= \w+\[([0-9,]*)\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\), "
                  r"lhs_contracting_dims=\{([0-9,]*)\}")
_YNN_BODY = re.compile(r"calls=%([\w.\-]+).*\"__ynn_fusion\"")


def _dims(text):
    return [int(d) for d in text.split(",")] if text else []


def slow_dot_flops(hlo_text):
    """``(slow, total)``: the FLOPs of the 16-bit floating-point dots one device runs per call of
    the program outside YNNPACK, and of all its dots (a dot in a loop body counted its known trip
    count times)."""
    bodies, entry = hlo_computations(hlo_text)
    if entry is None:
        raise ValueError("not the text of a compiled HLO module (no ENTRY computation)")
    runs, _ = hlo_multiplicities(bodies, entry)
    in_ynn = {m.group(1) for lines in bodies.values() for line in lines
              if (m := _YNN_BODY.search(line))}
    shapes = {m.group(1): (m.group(2), _dims(m.group(3))) for m in _DEFINITION.finditer(hlo_text)}
    slow = total = 0
    for name, count in runs.items():
        for line in bodies[name]:
            if match := _DOT.search(line):
                out, lhs, _, contracting = match.groups()
                flops = 2 * count
                for d in _dims(out):
                    flops *= d
                dtype, dims = shapes[lhs]
                for d in _dims(contracting):
                    flops *= dims[d]
                total += flops
                slow += flops if dtype in _NARROW and name not in in_ynn else 0
    return slow, total


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        slow, total = slow_dot_flops(f.read())
    print(f"{slow / 1e9:.1f} of {total / 1e9:.1f} GFLOP of dots in 16 bits outside YNNPACK "
          f"({slow / max(total, 1):.0%})")
