"""A run's workdir: local or remote paths, one run at a time (a lock), earlier runs moved aside.

Local paths are made absolute; URLs (``gs://bucket/run``, any scheme Orbax and ``etils.epath``
read) are kept as given. The lock is a small JSON file naming the run that holds the workdir
(host, pid, start time, and a sign of life its holder refreshes every minute); a lock whose
process is gone (same host: pid no longer alive; another host: no sign of life for
``STALE_AFTER_S``) is stale and taken over with a warning, so a run restarted on other machines
after a preemption continues without help. In a multi-process run process 0 takes the lock and
every process learns the outcome, so all of them stop together or none does.
"""

import json
import os
import socket
import threading
import time

from etils import epath

from ..errors import CheckpointError

LOCK_NAME = "redcoast.lock"
REFRESH_S = 60.0       # the holder rewrites its sign of life this often
STALE_AFTER_S = 600.0  # a lock from another host without sign of life for this long is stale


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


def _process_started(pid):
    """When process ``pid`` of this host started (seconds since the epoch), or None where
    /proc does not say (not Linux, gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _holder_running(holder):
    """Whether the run that wrote ``holder`` (a lock of this host) is still running: its pid
    is alive and is the same process, not a later one given the pid again (a container's pids
    restart at 1)."""
    pid = int(holder.get("pid", -1))
    if pid <= 0 or not _pid_alive(pid):
        return False
    started = _process_started(pid)
    # a process that began after the lock was written is not its writer (2 s: clock ticks)
    return started is None or started <= float(holder.get("started", 0)) + 2.0


UNREADABLE_AFTER_S = 5.0  # an empty or garbled lock this old was left by a crash mid-write


def _this_run():
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": now, "alive": now}


def agree(flag):
    """Process 0's ``flag`` on every process (decisions about shared files made once)."""
    import numpy as np

    from ..multihost.host import process_0s
    return bool(int(process_0s(np.int32(bool(flag)))))


class WorkdirLock:
    """Held by one run while it trains in ``workdir``; ``acquire()`` raises if another run holds it."""

    def __init__(self, workdir, logger=None):
        self.path = epath.Path(absolute(workdir)) / LOCK_NAME
        self.logger = logger
        self.held = False
        self._stop = self._thread = None

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
            if agree(error is not None) and error is None:
                raise CheckpointError(f"Process 0 could not lock the workdir ({self.path}); its "
                                      "error names the run holding it. Fix: see process 0's error.")
        if error is not None:
            raise error
        return self

    def _acquire_here(self):
        me = _this_run()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(4):
            if self._create(me):
                self._hold(me)
                return
            holder = self._read()
            if holder is None:  # vanished, being written, or left empty or garbled by a crash
                if self._unreadable_for() > UNREADABLE_AFTER_S:
                    self._warn(f"the workdir lock {self.path} is empty or unreadable and has not "
                               f"changed for {UNREADABLE_AFTER_S:.0f} s (a crash while it was "
                               "written?); taking it over.")
                    self.path.unlink(missing_ok=True)
                elif attempt < 3:
                    time.sleep(0.5 * (attempt + 1))
                continue
            if holder.get("host") == me["host"] and holder.get("pid") == me["pid"]:
                self._hold(me)  # this process already holds it (a second fit)
                return
            refusal, why_stale = self._judge(holder, me)
            if refusal is not None:
                raise refusal
            self._warn(f"the workdir lock {self.path} was left by process {holder.get('pid')} "
                       f"on {holder.get('host')}, {why_stale}; taking it over.")
            self.path.unlink(missing_ok=True)
        raise CheckpointError(
            f"Could not take the workdir lock {self.path}: it changed as this run looked, or is "
            "being written (another run starting in this workdir?). Fix: start one run at a time "
            f"in a workdir; a lock left empty or unreadable by a crash is taken over once it has "
            f"not changed for {UNREADABLE_AFTER_S:.0f} s.")

    def _judge(self, holder, me):
        """``(the error refusing this run, None)`` while ``holder``'s run is alive, else
        ``(None, why its lock is stale)``."""
        silent = time.time() - float(holder.get("alive", holder.get("started", 0)))
        same_host = holder.get("host") == me["host"]
        running = same_host and _holder_running(holder)
        if same_host and not running:
            return None, ("which is no longer running (a crash? its pid is gone or now another "
                          "process's)")
        if not same_host and silent > STALE_AFTER_S:
            return None, f"which has shown no sign of life for {silent:.0f} s"
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
        if running:  # deleting the lock would let this run destroy the live one's files
            fix = (f"wait for that run to end (or stop it: kill {holder.get('pid')}), or use "
                   "another workdir. Do not delete the lock while that process runs: it may "
                   "be writing a checkpoint.")
        else:
            fix = ("wait for that run to end or use another workdir; its lock is taken over "
                   f"by itself after {STALE_AFTER_S:.0f} s without sign of life, or delete "
                   f"{self.path} once you know that run has stopped.")
        return CheckpointError(
            f"The workdir {self.path.parent} is in use by another run (process "
            f"{holder.get('pid')} on host {holder.get('host')}, started {started}, last sign "
            f"of life {max(silent, 0):.0f} s ago); two runs writing the same checkpoints and "
            f"logs would destroy each other's. Fix: {fix}"), None

    def refuse_if_in_use(self):
        """Raise, on every process, if another live run holds the lock; nothing is taken or
        written (a Deployer asks before it opens the run's logs in the workdir)."""
        import jax
        error = None
        if jax.process_index() == 0:
            holder = self._read()
            me = _this_run()
            if holder is not None and not (holder.get("host") == me["host"]
                                           and holder.get("pid") == me["pid"]):
                error = self._judge(holder, me)[0]
        if jax.process_count() > 1 and agree(error is not None) and error is None:
            raise CheckpointError(f"Process 0 found the workdir {self.path.parent} in use by "
                                  "another run. Fix: see process 0's error.")
        if error is not None:
            raise error

    def _unreadable_for(self):
        """Seconds since the lock file last changed (0 if it is gone or remote)."""
        if is_url(self.path):
            return 0.0
        try:
            return time.time() - os.path.getmtime(self.path)
        except OSError:
            return 0.0

    def _hold(self, me):
        """Hold the lock, refreshing its sign of life from a background thread."""
        self.held = True
        self._stop = threading.Event()

        def refresh():
            while not self._stop.wait(REFRESH_S):
                try:
                    self._write({**me, "alive": time.time()})
                except OSError:  # a full or vanished disk must not kill the run
                    pass

        self._thread = threading.Thread(target=refresh, daemon=True, name="redcoast-workdir-lock")
        self._thread.start()

    def _write(self, record):
        if is_url(self.path):
            self.path.write_text(json.dumps(record))
            return
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(json.dumps(record))
        os.replace(tmp, self.path)

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
        if self._thread is not None:  # no refresh may recreate the file after it is removed
            self._stop.set()
            self._thread.join()
            self._thread = None
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
