"""``redcoast launch``'s command line: its options, checked before anything starts.

    redcoast launch -n 4 --local-devices 2 train.py --lr 3e-4
    python -m redcoast launch -n 4 --local-devices 2 train.py --lr 3e-4

What the launch does is in :mod:`redcoast.multihost.launcher`.
"""

import argparse
import os
import sys

from ..multihost.launcher import MAX_PROCESSES, Launcher, too_many_to_start
from ..simulate import MAX_SIMULATED_DEVICES
from .arg_types import positive_int, seconds


def main(argv=None):
    """Entry point of ``python -m redcoast.cli.launch_command``; returns the exit status."""
    options, command = parse_args(sys.argv[1:] if argv is None else argv)
    return Launcher(options, command).run()


def _parser():
    parser = argparse.ArgumentParser(
        prog="redcoast launch",
        usage="redcoast launch -n N [--local-devices K] [options] (script.py | -m module) [args ...]",
        description="Start N processes of one redcoast (jax.distributed) run on this machine. "
                    "The script is unchanged: Deployer() finds its process count, id and "
                    "coordinator from the REDCOAST_* variables set for each process.")
    parser.add_argument("-n", "--n-processes", type=positive_int, required=True, metavar="N",
                        help="number of processes to start")
    parser.add_argument("--local-devices", type=positive_int, metavar="K",
                        help="devices per process: K simulated CPU devices on CPU; on GPUs, "
                             "process i drives GPUs i*K .. i*K+K-1")
    parser.add_argument("--port", type=_port_arg, help="coordinator port (default: a free one)")
    parser.add_argument("--host0-address", default="127.0.0.1",
                        help="coordinator address (default 127.0.0.1)")
    parser.add_argument("--grace-period", type=seconds, default=5.0, metavar="S",
                        help="seconds the other processes get to exit after one fails, before "
                             "SIGKILL (default 5)")
    parser.add_argument("--stall-timeout", type=seconds, default=1800.0, metavar="S",
                        help="end the launch when a process has printed nothing and touched "
                             "no heartbeat for S seconds (redcoast's loops touch it every "
                             "batch; default 1800; 0: never)")
    parser.add_argument("--exit-timeout", type=seconds, default=60.0, metavar="S",
                        help="end the launch when a process exited with status 0 and the others "
                             "are still running S seconds later (default 60)")
    parser.add_argument("--stop-timeout", type=seconds, default=120.0, metavar="S",
                        help="seconds the processes get to save and exit after a SIGINT or "
                             "SIGTERM forwarded to them, before SIGKILL (default 120)")
    parser.add_argument("--allow-many", action="store_true",
                        help=f"start more than {MAX_PROCESSES} processes, or more than "
                             f"{MAX_SIMULATED_DEVICES} devices in all (slow: see the error "
                             "without it)")
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m")
    return parser


_TAKES_VALUE = {"-n", "--n-processes", "--local-devices", "--port", "--host0-address",
                "--grace-period", "--stall-timeout", "--exit-timeout", "--stop-timeout"}


def _port_arg(text):
    """A TCP port number, or a usage error saying which."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: use 1-65535 (or leave "
                                         "--port out for a free one)")
    return port


def parse_args(argv):
    """``(options, command)``: the launcher's own options, and the Python command to run."""
    argv = list(argv)
    i = 0
    while i < len(argv):  # the launcher's options end at the script (or after -m MODULE)
        token = argv[i]
        if token == "--":
            argv.pop(i)
            break
        if token == "-m":
            i += 2
            break
        if not token.startswith("-") or token == "-":
            break
        i += 1 if ("=" in token or token not in _TAKES_VALUE) else 2
    own, rest = argv[:i], argv[i:]
    parser = _parser()
    options = parser.parse_args(own)
    if options.module is None and not rest:
        parser.error("no script given. Fix: redcoast launch -n N script.py [args], or -m module.")
    too_many = too_many_to_start(options.n_processes, options.local_devices or 1)
    if too_many and not options.allow_many:
        parser.error(f"{too_many}. Fix: fewer, or --allow-many to start them all the same.")
    if options.module is not None:
        command = [sys.executable, "-u", "-m", options.module] + rest
    else:
        if not os.path.exists(rest[0]):
            parser.error(f"script {rest[0]!r} not found. Fix: give the path of a Python script.")
        command = [sys.executable, "-u"] + rest
    return options, command



if __name__ == "__main__":
    sys.exit(main())
