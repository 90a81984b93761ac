#!/usr/bin/env bash
# The checks to run when a session is lent one GPU, from the repository root on the GPU machine,
# as one prepared command per device call (a session has 15 minutes of device time; a start
# takes 1-2). Name the sections to run (default: mfu init generate):
#   mfu       benchmarks/gpu_mfu.py: a 1.1B Llama through the Trainer beside a hand-written step
#             and the Trainer's compiled step alone, MFU; four alternating rounds of 20 steps
#             (H200, 2026-11-30: 1.003x, 56.4% MFU; 5.5 minutes, 2.7 of them the init's compile
#             before models/base.INIT_COMPILER_OPTIONS, which made it 24 s)
#   init      benchmarks/init_compile.py --layers 22: the fresh parameters' compile (24.0 s)
#   generate  benchmarks/generate.py --real --model-shards 1: decode at batch 1 against the
#             device's read bandwidth, greedy and beam search against the hand loop (not yet
#             measured: on 2026-11-30 the bandwidth alone, 2758 GB/s for a 1 GiB read, came out
#             within 75 s; give it minutes, its 30-layer decode loops compile one by one)
#   plans     benchmarks/plan_vs_device.py: the plan's peaks (XLA:CPU, and `--target` this GPU's
#             description compiled for by XLA:GPU as if no GPU were here, each in a subprocess)
#             beside the GPU compiler's and the allocator's, and the memory check on a batch
#             too large (up to 8 minutes)
# The GPU image lacks tensorboardX: carry its wheel (pip download --no-deps tensorboardX) and put
# it on PYTHONPATH first. Results go to $OUT (the device tool's folder) or /tmp/gpu-checks.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 REDCOAST_CACHE=off
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
python3 -c "import tensorboardX" || { echo "tensorboardX is missing: carry its wheel"; exit 1; }
quiet() { grep -v -i -E "warning|slow_operation|\*\*\*\*"; }
sections=("$@")
[ $# -gt 0 ] || sections=(mfu init generate)
for section in "${sections[@]}"; do
    case $section in
    mfu) timeout 300 python3 benchmarks/gpu_mfu.py --rounds 4 --steps 20 2>&1 | quiet \
        | tee "$OUT/mfu.log" ;;
    init) timeout 120 python3 benchmarks/init_compile.py --layers 22 2>&1 | quiet \
        | tee "$OUT/init.log" ;;
    generate) timeout 300 python3 benchmarks/generate.py --real --model-shards 1 2>&1 | quiet \
        | tee "$OUT/generate.log" ;;
    plans)
        for row in "tinyllama-1.1b 1024 2" "gpt2-large 1024 2"; do
            set -- $row
            timeout 240 python3 benchmarks/plan_vs_device.py "benchmarks/configs/$1.json" \
                --seq-len "$2" --per-device-batch-size "$3" --gpu-target auto \
                --json "$OUT/$1.json" 2>&1 | grep -v Warning | tail -20
        done ;;
    *) echo "unknown section $section (mfu, init, generate, plans)"; exit 2 ;;
    esac
done
