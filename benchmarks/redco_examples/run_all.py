"""Run each adapted redco example on redcoast and, if the redco package is importable, on redco;
print the final results side by side. Needs transformers 4.x (Flax classes) for the Hugging Face
examples, and the adapted scripts themselves (redcoast carries no copy of redco's code): see
README.md. Usage: python benchmarks/redco_examples/run_all.py SCRIPTS_DIR [name ...]"""

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
EXAMPLES = ["language_modeling", "classification", "text_to_text", "mnist", "meta_learning",
            "differential_private_training", "federated_learning", "lora", "image_to_text"]


def run(scripts, name, run_on):
    env = dict(os.environ, RUN_ON=run_on,
               PYTHONPATH=os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as workdir:   # fresh workdirs: no resume between runs
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.join(scripts, f"{name}.py")], cwd=workdir,
                              env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    results = dict(re.findall(r"^RESULT (\w+)=(\S+)$", proc.stdout, re.M))
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        results = {"error": tail[0][:100]}
    return results, seconds


def main(scripts, names):
    sides = ["redcoast"] + (["redco"] if importlib.util.find_spec("redco") else [])
    print(f"{'example':20s} " + " | ".join(f"{s:>38s}" for s in sides))
    for name in names or EXAMPLES:
        cells = []
        for side in sides:
            results, seconds = run(scripts, name, side)
            shown = ", ".join(f"{k}={v}" for k, v in results.items())
            cells.append(f"{shown} ({seconds:.0f} s)")
        print(f"{name:20s} " + " | ".join(f"{c:>38s}" for c in cells), flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or not os.path.isdir(sys.argv[1]):
        sys.exit(__doc__)
    main(os.path.abspath(sys.argv[1]), sys.argv[2:])
