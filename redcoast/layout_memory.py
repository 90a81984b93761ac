"""The layout a run chose, remembered in its workdir so that the next run (a rerun, a resume)
starts without compiling the other candidates.

Choosing compiles every candidate training step at the first batch (up to four, minutes each on a
real model); the choice depends only on what the key below holds, so a run whose key matches the
workdir's ``layout.json`` takes the remembered candidate and compiles it alone. The layout is a
matter of speed and memory, never of the numbers: any candidate trains the same model. Delete
the file (or change what the key holds) to compare the candidates again.
"""

import dataclasses
import hashlib
import json
import os
import time

import jax
import numpy as np

FILE = "layout.json"


@dataclasses.dataclass(frozen=True)
class LayoutMemory:
    """Where a run's choice is kept (``path``) and what, besides the parameters and the first
    batch, it was chosen for: the run's ``devices`` and ``options`` (any JSON-able value, e.g.
    the fsdp / fusion choices, the shard counts, the compute dtype, the memory budget)."""
    path: str
    options: dict
    devices: tuple

    @classmethod
    def in_workdir(cls, workdir, options, devices):
        return cls(os.path.join(workdir, FILE), options, tuple(devices))

    def key(self, params, batch):
        """A digest of what the choice depends on: the parameters' and the first batch's paths,
        shapes and dtypes (abstract or concrete), the devices (kind, count, processes), the
        options and the jax version."""
        def shapes(tree):
            return [(jax.tree_util.keystr(path), tuple(leaf.shape), str(np.dtype(leaf.dtype)))
                    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]
        record = {"params": shapes(params), "batch": shapes(batch),
                  "devices": sorted({getattr(d, "device_kind", d.platform) for d in self.devices}),
                  "n_devices": len(self.devices), "n_processes": jax.process_count(),
                  "options": self.options, "jax": jax.__version__}
        return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()

    def recall(self, params, batch, candidate_type):
        """The candidate remembered for this key (``candidate_type(**fields)``), or None: no
        file, another key, or a file that cannot be read (then the choice is made again)."""
        try:
            with open(self.path) as f:
                record = json.load(f)
            if record.get("key") != self.key(params, batch):
                return None
            return candidate_type(**record["candidate"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def remember(self, params, batch, candidate, reason):
        """Write ``candidate`` (a dataclass) as the choice for this key (process 0; whole or not
        at all)."""
        if jax.process_index() != 0:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        temporary = f"{self.path}.tmp-{os.getpid()}"
        with open(temporary, "w") as f:
            json.dump({"key": self.key(params, batch), "candidate": dataclasses.asdict(candidate),
                       "reason": reason, "chosen_at": time.strftime("%Y-%m-%d %H:%M:%S")},
                      f, indent=1)
        os.replace(temporary, self.path)
