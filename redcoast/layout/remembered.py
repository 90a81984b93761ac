"""The layout a run chose, remembered in its workdir (and in the per-user cache, user_cache.py)
so that the next run (a rerun, a resume, the same script in a new workdir) starts without
compiling the other candidates.

Choosing compiles every candidate training step at the first batch (up to four, minutes each on a
real model); the choice depends only on what the key below holds, so a run whose key matches the
workdir's ``layout.json``, or a file of that key in the per-user cache, takes the remembered
candidate and compiles it alone. The layout is a matter of speed and memory, never of the
numbers: any candidate trains the same model. Delete the file (or change what the key holds) to
compare the candidates again.
"""

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable

import jax
import numpy as np

FILE = "layout.json"


@dataclasses.dataclass(frozen=True)
class LayoutMemory:
    """Where a run's choice is kept (``path``: the workdir's file, or None; ``cache_dir``: the
    per-user cache's directory, one file per key, or None) and what, besides the parameters and
    the first batch, it was chosen for: the run's ``devices`` and ``options`` (any JSON-able
    value, e.g. the fsdp / fusion choices, the shard counts, the compute dtype, the budget).
    ``warn(text)`` says why a file was not taken (default: this module's logger)."""
    path: str | None
    options: dict
    devices: tuple
    cache_dir: str | None = None
    warn: Callable[[str], None] | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def in_workdir(cls, workdir, options, devices, cache_dir=None, warn=None):
        path = None if workdir is None else os.path.join(workdir, FILE)
        return cls(path, options, tuple(devices), cache_dir, warn)

    def places(self):
        """Where choices are written, for the log."""
        return [p for p in (self.path, self.cache_dir) if p is not None]

    def _files(self, key):
        """The files that may hold this key's choice, the workdir's first."""
        cached = None if self.cache_dir is None else os.path.join(self.cache_dir, f"{key}.json")
        return [f for f in (self.path, cached) if f is not None]

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
        """``(candidate, the file it was read from)`` remembered for this key
        (``candidate_type(**fields)``), or None: no file, another key, or a file that cannot be
        read or holds a candidate this run cannot take (e.g. edited by hand); those two are
        said (``warn``), and the choice is made again and written over them."""
        key = self.key(params, batch)
        for path in self._files(key):
            if not os.path.exists(path):
                continue
            try:
                with open(path) as f:
                    record = json.load(f)
                if not isinstance(record, dict):
                    raise ValueError(f"a JSON {type(record).__name__}, not an object")
            except (OSError, ValueError) as e:
                self._ignored(path, f"it cannot be read as JSON ({e})")
                continue
            if record.get("key") != key:
                continue  # another model, batch, devices or options: not this run's choice
            wrong = self._impossible(record.get("candidate"), candidate_type)
            if wrong:
                self._ignored(path, wrong)
                continue
            return candidate_type(**record["candidate"]), path
        return None

    def _impossible(self, fields, candidate_type):
        """Why ``fields`` (a record's candidate) cannot be this run's layout, or None."""
        names = [f.name for f in dataclasses.fields(candidate_type)]
        if not isinstance(fields, dict) or sorted(fields) != sorted(names):
            return f"its candidate is {fields!r}, not the fields {names}"
        n = fields.get("n_model_shards")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or len(self.devices) % n:
            return (f"n_model_shards={n!r} does not divide the run's {len(self.devices)} "
                    "devices into model shards")
        counts = self.options.get("shard_counts")
        if counts is not None and n not in counts:
            return f"n_model_shards={n} is not among this run's choices {counts}"
        for name, allowed in (("fsdp", self.options.get("fsdp")),
                              ("fuse_matmuls", self.options.get("fuse_matmuls"))):
            value = fields[name]
            if name == "fuse_matmuls" and value is False:
                continue  # what one model shard always takes
            if allowed is not None and not any(type(value) is type(a) and value == a
                                               for a in allowed):
                return f"{name}={value!r} is not among this run's choices {allowed}"
        return None

    def _ignored(self, path, why):
        text = (f"{path} is ignored: {why}. The layout is chosen again and written there. Fix: "
                "nothing to do; to pin a layout, pass Deployer(n_model_shards=...) instead of "
                "editing the file.")
        (self.warn or logging.getLogger(__name__).warning)(text)

    def remember(self, params, batch, candidate, reason):
        """Write ``candidate`` (a dataclass) as the choice for this key, in the workdir and the
        per-user cache (process 0; each file whole or not at all; a cache that cannot be
        written is skipped: it only saves time)."""
        if jax.process_index() != 0:
            return
        key = self.key(params, batch)
        record = {"key": key, "candidate": dataclasses.asdict(candidate), "reason": reason,
                  "chosen_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        for path in self._files(key):
            try:
                _write_whole(path, record)
            except OSError:
                if path == self.path:
                    raise


def _write_whole(path, record):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(temporary, path)
