"""Run an example the way a user does (``python examples/NAME/main.py --tiny``) and read its metrics.

Every example accepts ``--tiny`` (a run short enough for CI) and ``--metrics-out PATH`` (the final
metrics as a JSON object). The example runs in its own process, with its own simulated devices,
from the repository root, so its imports, devices and files are those a user gets.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_example(name, *args, timeout=None, tiny=True, check_layout=True):
    """Run ``examples/<name>/main.py --tiny --check-layout *args`` (without ``--tiny`` if not
    ``tiny``, without ``--check-layout``, the layout checked against one device before training,
    if not ``check_layout``);
    return ``(metrics, seconds)``.

    Raises ``AssertionError`` with the example's output when it fails.
    """
    workdir = ROOT / "workdir" / "example-tests" / name
    workdir.mkdir(parents=True, exist_ok=True)
    metrics_path = workdir / "metrics.json"
    metrics_path.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # the example chooses its devices itself, as it would for a user
    command = [sys.executable, str(ROOT / "examples" / name / "main.py"), *(["--tiny"] if tiny else []),
               "--metrics-out", str(metrics_path), *(["--check-layout"] if check_layout else []), *args]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout or (900 if tiny else None))
    seconds = time.perf_counter() - start
    assert done.returncode == 0, (
        f"{' '.join(command)} exited with {done.returncode}\n"
        f"--- stdout (tail)\n{done.stdout[-4000:]}\n--- stderr (tail)\n{done.stderr[-4000:]}")
    return json.loads(metrics_path.read_text()), seconds
