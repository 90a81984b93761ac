#!/usr/bin/env bash
# The checks to run when a session is lent one GPU, as one prepared command (about 8 minutes on
# an H100 before the --gpu-target plans, which are not yet timed there), from the repository root
# on the GPU machine:
#   1. benchmarks/gpu_mfu.py: a 1.1B Llama through the Trainer beside a hand-written step, MFU;
#      four alternating rounds of 20 steps (2 x 10 left the Trainer at 1.067x on 2026-11-26);
#   2. benchmarks/plan_vs_device.py: the plan's peaks (XLA:CPU, and `--target` this GPU's
#      description compiled for by XLA:GPU as if no GPU were here, each in a subprocess) beside
#      the GPU compiler's and the allocator's, and the memory check on a batch too large.
# The GPU image lacks tensorboardX: carry its wheel (pip download --no-deps tensorboardX) and put
# it on PYTHONPATH first. Results go to $OUT (the device tool's folder) or /tmp/gpu-checks.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 REDCOAST_CACHE=off
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
python3 -c "import tensorboardX" || { echo "tensorboardX is missing: carry its wheel"; exit 1; }
timeout 300 python3 benchmarks/gpu_mfu.py --rounds 4 --steps 20 2>&1 | tee "$OUT/mfu.log"
for row in "tinyllama-1.1b 1024 2" "gpt2-large 1024 2"; do
    set -- $row
    timeout 240 python3 benchmarks/plan_vs_device.py "benchmarks/configs/$1.json" --seq-len "$2" \
        --per-device-batch-size "$3" --gpu-target auto --json "$OUT/$1.json" 2>&1 | grep -v Warning | tail -20
done
