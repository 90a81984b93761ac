"""Run an example the way a user does (``python examples/NAME/main.py --tiny``) and read its metrics.

Every example accepts ``--tiny`` (a run short enough for CI) and ``--metrics-out PATH`` (the final
metrics as a JSON object). The example runs in its own process, with its own simulated devices and
the repository on its path, as a user's does, from a folder emptied before each run: an example
resumes from the checkpoints in its ``workdir/`` (relative to where it runs), so a second run from
the repository root found the first one's finished run and trained nothing, and passed.
"""

import json
import os
import shutil
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
    # one folder per command: two runs of one example with other arguments may run at once
    workdir = ROOT / "workdir" / "example-tests" / "-".join((name, *args)).replace("/", "_")
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    metrics_path = workdir / "metrics.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # the example chooses its devices itself, as it would for a user
    command = [sys.executable, str(ROOT / "examples" / name / "main.py"), *(["--tiny"] if tiny else []),
               "--metrics-out", str(metrics_path), *(["--check-layout"] if check_layout else []), *args]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout or (900 if tiny else None))
    seconds = time.perf_counter() - start
    assert done.returncode == 0, (
        f"{' '.join(command)} exited with {done.returncode}\n"
        f"--- stdout (tail)\n{done.stdout[-4000:]}\n--- stderr (tail)\n{done.stderr[-4000:]}")
    return json.loads(metrics_path.read_text()), seconds
