"""The launcher behind ``redcoast launch``: N processes of one run on this machine, supervised.

Each process runs the unchanged script; ``Deployer()`` finds its place in the run from the
``REDCOAST_*`` variables set here (coordinator 127.0.0.1 on a free port, process count and id,
local device count) and starts ``jax.distributed``. Every line a process prints is prefixed with
its index (``[0] ...``); a line longer than 1 MiB is relayed in pieces, each prefixed so (the
relay's time stays linear in the output). SIGINT and SIGTERM are forwarded to all processes. When one process
fails, the others are stopped (SIGTERM, then SIGKILL after ``--grace-period`` seconds) and the
launcher exits non-zero, naming the process, how it ended, and its last lines of output.

A watchdog also ends the launch, naming the process, when a process exits with status 0 (or its
script returns: it may then wait in JAX's shutdown barrier) while the others keep running for
``--exit-timeout`` seconds (an early exit the others would otherwise wait for, or later blame on a
survivor), and when a process makes no progress for
``--stall-timeout`` seconds (a hang; each process on its own, so a chatty one cannot hide a hung
one). Progress is any output (a line or part of one) or a touch of the file named by
``REDCOAST_HEARTBEAT_FILE`` (:func:`heartbeat`; redcoast's training, evaluation and prediction loops touch it every batch).
A forwarded SIGINT or SIGTERM gives the processes ``--stop-timeout`` seconds to save and exit,
then SIGKILL. A ``--port`` already in use, on any address of this machine, is reported before
anything starts, as are counts that are not positive integers, durations that are not seconds,
and more than 64 processes or 1024 devices in all (slow to start: ``--allow-many`` to start
them all the same, with a warning).
"""

import collections
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from ..simulate import MAX_SIMULATED_DEVICES
from . import distributed
from .heartbeat import ENV_HEARTBEAT_FILE

POLL_S = 0.05
TAIL_LINES = 30
TAIL_LINE_CHARS = 2000       # of each line, in the failure report
MAX_LINE_BYTES = 1 << 20     # a longer line is relayed in pieces of this many bytes
EARLY_EXIT_FIX = ("every process must run the script to its end (no sys.exit / return on some "
                  "processes only); to stop a run early, raise an error or stop all processes.")
_FORCE_DEVICES_FLAG = re.compile(r"--xla_force_host_platform_device_count(=\S*)?")
_LINE_END = re.compile(rb"[\r\n]")
# The most processes started unasked (--allow-many for more): each is a Python process starting
# JAX (about 0.3 GB and a second or two of a core); one machine's run needs one per GPU or a few
# simulated hosts.
MAX_PROCESSES = 64


def too_many_to_start(n, local_devices):
    """Why ``n`` processes of ``local_devices`` devices each are more than this machine should
    start unasked; None when they are not."""
    if n > MAX_PROCESSES:
        return (f"-n {n}: {n} processes on this machine, more than the {MAX_PROCESSES} started "
                "unasked; each is a Python process starting JAX (about 0.3 GB of memory and a "
                "second or two of a core)")
    if n * local_devices > MAX_SIMULATED_DEVICES:
        return (f"-n {n} --local-devices {local_devices}: {n * local_devices} devices in all (on "
                f"CPUs, {local_devices} simulated in each process), more than the "
                f"{MAX_SIMULATED_DEVICES} started unasked; JAX's start and a run's collectives slow "
                "down with the count (one process took over 200 s to start 16384 simulated "
                "devices)")
    return None

def port_in_use(host, port):
    """True if something on this machine already holds ``port`` where the coordinator would
    listen: on ``host``, and on every address (it binds the wildcard), so a port taken on
    another local address counts too. False if ``host`` is not an address of this machine:
    then only the coordinator's host can tell."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    host = "127.0.0.1" if host == "localhost" else host
    for address in (host, "::" if family == socket.AF_INET6 else "0.0.0.0"):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
                if address == host:  # not an address of this machine
                    return False
    return False


def free_port(host="127.0.0.1"):
    """A TCP port that nothing listens on at the moment."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(base, n, i, host, port, local_devices):
    """The environment of process ``i``: the launcher's, plus where it stands in the run."""
    env = dict(base)
    env.update({distributed.ENV_N_PROCESSES: str(n), distributed.ENV_PROCESS_ID: str(i),
                distributed.ENV_HOST0_ADDRESS: host, distributed.ENV_HOST0_PORT: str(port),
                distributed.ENV_LOCAL_PROCESS_ID: str(i), "PYTHONUNBUFFERED": "1"})
    if local_devices is not None:
        env[distributed.ENV_N_LOCAL_DEVICES] = str(local_devices)
        # An inherited --xla_force_host_platform_device_count would fight --local-devices.
        flags = _FORCE_DEVICES_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
        if flags:
            env["XLA_FLAGS"] = " ".join(flags)
        else:
            env.pop("XLA_FLAGS", None)
    return env


def describe_exit(returncode):
    """``'exited with code 1'`` or ``'was killed by signal 9 (SIGKILL)'``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


def _die_with_parent():
    """In the child: be killed if the launcher dies (Linux), so no process is left orphaned."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class _Output:
    """Copies one process's stdout or stderr to ours, each line prefixed with its index, in time
    linear in the output: a line longer than ``max_line`` bytes is written in pieces of at most
    that (each prefixed, and ended, as a line). ``progress[index]`` is the time it last printed
    anything, a piece of a line included; ``unfinished`` is the line it has begun and not ended."""

    lock = threading.Lock()

    def __init__(self, pipe, prefix, sink, tail, progress=None, index=0, max_line=MAX_LINE_BYTES):
        self.pipe, self.prefix, self.sink, self.tail = pipe, prefix.encode(), sink, tail
        self.progress, self.index, self.max_line = progress, index, max_line
        self.unfinished = bytearray()
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self):
        fd = self.pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            if self.progress is not None:
                self.progress[self.index] = time.monotonic()
            self._take(chunk)
        if self.unfinished:
            self._write(bytes(self.unfinished) + b"\n")
            self.unfinished.clear()
        self.pipe.close()

    def _take(self, chunk):
        """Write the lines ``chunk`` ends; keep what follows the last one. Only the new bytes
        are searched, so a long line costs its length once (not once per read)."""
        start = 0
        # A line ends at \n, or at \r (progress bars redraw themselves with it).
        for end in _LINE_END.finditer(chunk):
            self.unfinished += chunk[start:end.start()]
            self._write_pieces()
            self._write(bytes(self.unfinished) + end.group())
            self.unfinished.clear()
            start = end.end()
        self.unfinished += chunk[start:]
        self._write_pieces()

    def _write_pieces(self):
        """Write the unfinished line's first pieces, as lines, while it is over ``max_line``."""
        while len(self.unfinished) > self.max_line:
            cut = _utf8_boundary(self.unfinished, self.max_line)
            self._write(bytes(self.unfinished[:cut]) + b"\n")
            del self.unfinished[:cut]  # from the front of a bytearray: no copy of the rest

    def _write(self, line):
        text = line.rstrip(b"\r\n")
        if text:
            self.tail.append(_tail_text(text))
        with self.lock:
            try:
                self.sink.write(self.prefix + line)
                self.sink.flush()
            except (OSError, ValueError):  # our own output is gone; keep draining the pipe
                pass


def _utf8_boundary(data, limit):
    """The cut nearest below ``limit`` (``data[limit]`` exists) that splits no UTF-8 character;
    ``limit`` itself when the bytes there are not UTF-8."""
    for cut in range(limit, max(limit - 4, 0), -1):
        if data[cut] & 0xC0 != 0x80:  # not a continuation byte: a character starts here
            return cut
    return limit


def _tail_text(line):
    """A line as the failure report shows it: its first TAIL_LINE_CHARS bytes at most."""
    if len(line) <= TAIL_LINE_CHARS:
        return line.decode(errors="replace")
    return (line[:TAIL_LINE_CHARS].decode(errors="replace")
            + f" ... ({len(line) - TAIL_LINE_CHARS} more bytes)")


class Launcher:
    """Runs ``command`` as ``options.n_processes`` processes and supervises them."""

    def __init__(self, options, command):
        self.options = options
        self.command = command
        self.procs = []
        self.outputs = []
        self.tails = []
        self.signals = []
        self.failed = None        # (index, returncode) of the first process that failed
        self.reason = None        # why the watchdog ended the launch, when it did
        self.fix = None           # and what to do about it
        self.stop_started = None  # when the others were told to stop
        self.early_exit = None    # (index, time) of a process that exited 0 before the others
        self.progress = []        # per process: when it last printed or touched its heartbeat
        self.signal_deadline = None  # SIGKILL then, after a forwarded SIGINT / SIGTERM

    def log(self, text):
        with _Output.lock:
            print(f"redcoast launch: {text}", file=sys.stderr, flush=True)

    def run(self):
        n, o = self.options.n_processes, self.options
        if o.port and port_in_use(o.host0_address, o.port):
            self.log(f"port {o.port} on {o.host0_address} (or on another address of this "
                     f"machine: the coordinator listens on all) is already in use, so the coordinator "
                     f"cannot listen there. Fix: choose another --port, or leave --port out to "
                     "use a free one.")
            return 2
        port = o.port or free_port(o.host0_address if o.host0_address != "localhost" else "127.0.0.1")
        width = len(str(n - 1))
        too_many = too_many_to_start(n, o.local_devices or 1)
        if too_many:  # allowed (--allow-many), said all the same
            self.log(f"warning: {too_many}; --allow-many: starting them, slowly.")
        self.log(f"starting {n} process(es), coordinator {o.host0_address}:{port}"
                 + (f", {o.local_devices} device(s) each" if o.local_devices else "")
                 + f": {' '.join(self.command[2:])}")
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        beats = tempfile.TemporaryDirectory(prefix="redcoast-launch-")
        self.heartbeats = [os.path.join(beats.name, f"heartbeat-{i}") for i in range(n)]
        self.returned = [os.path.join(beats.name, f"returned-{i}") for i in range(n)]
        self.progress = [time.monotonic()] * n
        try:
            for i in range(n):
                env = child_env(os.environ, n, i, o.host0_address, port, o.local_devices)
                env[ENV_HEARTBEAT_FILE] = self.heartbeats[i]
                env[distributed.ENV_RETURNED_FILE] = self.returned[i]
                self.procs.append(subprocess.Popen(
                    self.command, env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True, preexec_fn=_die_with_parent))
            for i, p in enumerate(self.procs):
                tail = collections.deque(maxlen=TAIL_LINES)
                self.tails.append(tail)
                prefix = f"[{i:>{width}}] "
                self.outputs += [_Output(p.stdout, prefix, sys.stdout.buffer, tail, self.progress, i),
                                 _Output(p.stderr, prefix, sys.stderr.buffer, tail, self.progress, i)]
            self.started = time.monotonic()
            self._supervise()
        finally:
            self._kill_all(signal.SIGKILL)
            for s, handler in previous.items():
                signal.signal(s, handler)
            beats.cleanup()
        # Copy what is still in the pipes (a busy machine may lag); a process's own children
        # that keep a pipe open cannot hold the launcher for more than a few seconds.
        deadline = time.monotonic() + 10
        for out in self.outputs:
            out.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return self._report()

    def _on_signal(self, signum, frame):
        self.signals.append(signum)
        if self.signal_deadline is None:  # a process that never reaches a step boundary
            self.signal_deadline = time.monotonic() + self.options.stop_timeout
        if len(self.signals) >= 3:  # asked three times: stop now
            self._kill_all(signal.SIGKILL)
        else:
            self._kill_all(signum)

    def _kill_all(self, signum):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signum)  # the process and anything it started
                except (ProcessLookupError, PermissionError):
                    pass

    def _script_returned(self, i):
        """Process ``i``'s script has ended cleanly, though the process may still be running
        (in JAX's shutdown barrier, waiting for the others)."""
        return os.path.exists(self.returned[i])

    @staticmethod
    def _how_it_left(i, codes):
        return ("exited with code 0" if codes[i] == 0 else "returned from its script (status 0; "
                "then waiting in JAX's shutdown for the others)")

    def _supervise(self):
        while True:
            codes = [p.poll() for p in self.procs]
            now = time.monotonic()
            for i, c in enumerate(codes):
                if (c == 0 or (c is None and self._script_returned(i))) and self.early_exit is None:
                    self.early_exit = (i, now)
                if c not in (None, 0) and self.failed is None and not self.signals:
                    self.failed = (i, c)
                    if self.early_exit is not None:  # the survivor lost its peer: blame the peer
                        j, t = self.early_exit
                        self.failed = (j, 0)
                        self.reason = (f"{self._how_it_left(j, codes)} after {t - self.started:.1f} s while "
                                       f"the others were still running; process {i} then "
                                       f"{describe_exit(c)} (a lost peer)")
                        self.fix = EARLY_EXIT_FIX
                    self._stop(f"process {i} {describe_exit(c)}")
            if all(c is not None for c in codes):  # after this poll's exits are accounted for
                return
            if self.failed is None and not self.signals:
                self._watchdog(codes, now)
            if self.signal_deadline is not None and now > self.signal_deadline:
                self.log(f"processes still running {self.options.stop_timeout:g} s after the "
                         "signal (--stop-timeout); killing them.")
                self.signal_deadline = float("inf")
                self._kill_all(signal.SIGKILL)
            if (self.stop_started is not None
                    and time.monotonic() - self.stop_started > self.options.grace_period):
                self._kill_all(signal.SIGKILL)
            time.sleep(POLL_S)

    def _stop(self, what):
        self.stop_started = time.monotonic()
        self.log(f"{what}; stopping the other processes.")
        self._kill_all(signal.SIGTERM)

    def _watchdog(self, codes, now):
        """End the launch on an early exit with status 0 or when no process makes progress."""
        o = self.options
        working = [k for k, c in enumerate(codes) if c is None and not self._script_returned(k)]
        if self.early_exit is not None:
            i, t = self.early_exit
            if working and now - t > o.exit_timeout:
                self.failed = (i, 0)
                self.reason = (f"{self._how_it_left(i, codes)} after {t - self.started:.1f} s while the "
                               f"others were still running {o.exit_timeout:g} s later (an early "
                               "exit: a run's processes end together)")
                self.fix = EARLY_EXIT_FIX
                self._stop(f"process {i} exited early with code 0")
            return
        if not o.stall_timeout:
            return
        for i, path in enumerate(self.heartbeats):
            try:  # a touched heartbeat counts as progress (mtime in wall-clock time)
                age = time.time() - os.stat(path).st_mtime
                self.progress[i] = max(self.progress[i], now - age)
            except OSError:
                pass
        if not working:  # all left their scripts: JAX's shutdown barrier is theirs to time
            return
        # each process on its own: one that prints (a monitoring thread) must not hide a hung one
        i = min(working, key=lambda k: self.progress[k])
        if now - self.progress[i] > o.stall_timeout:
            quiet = ", ".join(f"process {k} {now - t:.0f} s" for k, t in enumerate(self.progress))
            self.failed = (i, None)
            self.reason = (f"made no progress (no output, no heartbeat) for "
                           f"{now - self.progress[i]:.0f} s, longest of all (silent for: {quiet}): "
                           f"hung? (--stall-timeout {o.stall_timeout:g} s)")
            self.fix = (f"find where process {i} waits (its last lines above; `py-spy dump --pid "
                        f"{self.procs[i].pid}` while it hangs), or raise --stall-timeout if it was "
                        "only slow (long compilation prints nothing; redcoast.multihost.heartbeat.heartbeat() "
                        "reports progress without output).")
            self._stop(f"process {i} made no progress for {o.stall_timeout:g} s")

    def _report(self):
        n = len(self.procs)
        if self.failed is not None:
            i, code = self.failed
            took = time.monotonic() - self.stop_started
            lines = "\n".join(f"  [{i}] {line}" for line in self.tails[i])
            how = self.reason or f"{describe_exit(code)} after {self.stop_started - self.started:.1f} s"
            fix = self.fix or (f"see process {i}'s error above (lines prefixed [{i}]); the other "
                               "processes' errors about a lost peer follow from it.")
            self.log(
                f"FAILED: process {i} of {n} (pid {self.procs[i].pid}) {how}; the other processes "
                f"were stopped in {took:.1f} s. Its last lines of output:\n{lines or '  (none)'}\n"
                f"Fix: {fix}")
            if not code:  # an early exit 0, or a hang: the launch failed all the same
                return 1
            return code if code > 0 else 128 - code
        if self.signals:
            name = signal.Signals(self.signals[0]).name
            self.log(f"stopped by {name}, forwarded to all {n} processes.")
            return 128 + self.signals[0]
        bad = [(i, p.returncode) for i, p in enumerate(self.procs) if p.returncode != 0]
        if bad:  # cannot happen without a failure above; kept for safety
            i, code = bad[0]
            lines = "\n".join(f"  [{i}] {line}" for line in self.tails[i])
            self.log(f"FAILED: process {i} {describe_exit(code)}. Its last lines of output:\n"
                     f"{lines or '  (none)'}")
            return code if code > 0 else 128 - code
        return 0

