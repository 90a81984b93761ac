"""A run's workdir: local or remote paths, one run at a time (a lock), earlier runs moved aside.

Local paths are made absolute; URLs (``gs://bucket/run``, any scheme Orbax and ``etils.epath``
read) are kept as given. The lock is a small JSON file naming the run that holds the workdir
(host, pid, start time); a lock whose process is gone (same host, pid no longer alive) is stale
and taken over with a warning. In a multi-process run process 0 takes the lock and every process
learns the outcome, so all of them stop together or none does.
"""

import json
import os
import socket
import time

from etils import epath

from .errors import CheckpointError

LOCK_NAME = "redcoast.lock"


def is_url(path):
    return "://" in str(path)


def absolute(path):
    """``path`` as a string: absolute if local, unchanged if a URL."""
    return str(path) if is_url(path) else os.path.abspath(path)


def join(*parts):
    return str(epath.Path(parts[0]).joinpath(*parts[1:])) if is_url(parts[0]) else os.path.join(*parts)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _this_run():
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}


class WorkdirLock:
    """Held by one run while it trains in ``workdir``; ``acquire()`` raises if another run holds it."""

    def __init__(self, workdir, logger=None):
        self.path = epath.Path(absolute(workdir)) / LOCK_NAME
        self.logger = logger
        self.held = False

    def acquire(self):
        """Take the lock (process 0), and agree on the outcome with every process."""
        import jax
        error = None
        if jax.process_index() == 0:
            try:
                self._acquire_here()
            except CheckpointError as e:
                error = e
        if jax.process_count() > 1:
            import numpy as np
            from jax.experimental import multihost_utils
            failed = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
            if int(failed) and error is None:
                raise CheckpointError(f"Process 0 could not lock the workdir ({self.path}); its "
                                      "error names the run holding it. Fix: see process 0's error.")
        if error is not None:
            raise error
        return self

    def _acquire_here(self):
        me = _this_run()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            if self._create(me):
                self.held = True
                return
            holder = self._read()
            if holder is None:  # vanished or half-written while we looked: try once more
                continue
            if holder.get("host") == me["host"] and holder.get("pid") == me["pid"]:
                self.held = True  # this process already holds it (a second fit)
                return
            if holder.get("host") == me["host"] and not _pid_alive(int(holder.get("pid", -1))):
                self._warn(f"the workdir lock {self.path} was left by process {holder.get('pid')} "
                           f"on {holder.get('host')}, which is no longer running (a crash?); "
                           "taking it over.")
                self.path.unlink(missing_ok=True)
                continue
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
            raise CheckpointError(
                f"The workdir {self.path.parent} is in use by another run (process "
                f"{holder.get('pid')} on host {holder.get('host')}, started {started}); two runs "
                "writing the same checkpoints would destroy each other's. Fix: wait for that run "
                f"to end, use another workdir, or, if that run is gone, delete {self.path}.")
        raise CheckpointError(f"Could not take the workdir lock {self.path}. Fix: delete it if "
                              "no run uses this workdir.")

    def _create(self, me):
        text = json.dumps(me)
        if is_url(self.path):  # object stores have no exclusive create: check, then write
            if self.path.exists():
                return False
            self.path.write_text(text)
            return True
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True

    def _read(self):
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def release(self):
        import jax
        if self.held and jax.process_index() == 0:
            holder = self._read()
            if holder is not None and holder.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
        self.held = False

    def _warn(self, text):
        if self.logger is not None:
            self.logger.warning(text)
        else:
            print(f"WARNING: {text}")


def move_aside(directory, reason, logger=None):
    """Rename ``directory`` to ``<directory>.<reason>-<UTC time>`` (process 0); the new name."""
    import jax
    src = epath.Path(absolute(directory))
    dst = src.parent / f"{src.name}.{reason}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    if jax.process_index() == 0:
        n = 1
        while dst.exists():
            dst = dst.parent / f"{dst.name.split('~')[0]}~{n}"
            n += 1
        src.rename(dst)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(f"redcoast.move_aside:{src}")
    return str(dst)
