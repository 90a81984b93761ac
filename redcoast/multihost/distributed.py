"""Starting JAX's multi-process runtime (``jax.distributed``), wherever the processes come from.

Where the run's layout comes from, first match wins:

1. explicit arguments (``Deployer(n_processes=..., host0_address=..., process_id=...)``);
2. ``REDCOAST_*`` environment variables, set by ``redcoast launch`` (or by hand);
3. SLURM (one process per task of an ``srun`` step; the first host of the node list is the
   coordinator), Open MPI (``mpirun``; the host that ran ``mpirun`` is the coordinator), or a
   cloud TPU pod (JAX's own detection).

Nothing found means one process. The collectives are JAX's own (XLA over NCCL on GPUs, gloo on
CPUs); redcoast only chooses the arguments of ``jax.distributed.initialize`` and its timeouts, so
that no process waits forever for a dead peer.
"""

import atexit
import dataclasses
import os
import re
import socket
import sys
import threading
import time
import zlib

import jax

from ..errors import ConfigError
from ..simulate import simulate_cpu_devices

DEFAULT_PORT = 11111

# Set by ``redcoast launch`` for each process it starts; a script never needs to read them.
ENV_N_PROCESSES = "REDCOAST_N_PROCESSES"
ENV_PROCESS_ID = "REDCOAST_PROCESS_ID"
ENV_HOST0_ADDRESS = "REDCOAST_HOST0_ADDRESS"
ENV_HOST0_PORT = "REDCOAST_HOST0_PORT"
ENV_N_LOCAL_DEVICES = "REDCOAST_N_LOCAL_DEVICES"
ENV_LOCAL_PROCESS_ID = "REDCOAST_LOCAL_PROCESS_ID"
# A file this process creates when its script has returned (or called sys.exit(0)), before JAX's
# exit handler waits at the shutdown barrier for the others: how the launcher tells a process
# that left early from one still working.
ENV_RETURNED_FILE = "REDCOAST_RETURNED_FILE"
# Seconds: to wait for every process to join, without a heartbeat before a process counts as
# dead, and at exit for the others to finish (JAX's defaults are 300, 100 and 300).
ENV_INIT_TIMEOUT = "REDCOAST_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "REDCOAST_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "REDCOAST_SHUTDOWN_TIMEOUT"
TIMEOUT_DEFAULTS = {ENV_INIT_TIMEOUT: 300, ENV_HEARTBEAT_TIMEOUT: 60, ENV_SHUTDOWN_TIMEOUT: 300}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """One process's place in a multi-process run, as found by :func:`detect`."""

    source: str                     # where it was found, e.g. "SLURM"
    n_processes: int
    process_id: int | None          # None: left to JAX's detection (cloud TPU)
    coordinator: str | None         # "host:port" of process 0; None: left to JAX (cloud TPU)
    local_device_ids: tuple | None = None   # accelerators this process drives; None: all
    jax_detection: str | None = None        # JAX's cluster_detection_method, if JAX finds the rest


def detect(n_processes=None, host0_address=None, host0_port=None, process_id=None, env=None):
    """The multi-process run this process belongs to, or None for a single process.

    Reads only its arguments and ``env`` (default ``os.environ``); starts nothing.
    """
    env = os.environ if env is None else env
    if n_processes is not None or host0_address is not None or process_id is not None:
        return _from_arguments(n_processes, host0_address, host0_port, process_id)
    if ENV_N_PROCESSES in env:
        return _from_redcoast_env(env, host0_port)
    for finder in (_from_slurm, _from_open_mpi, _from_cloud_tpu):
        found = finder(env, host0_port)
        if found is not None:
            return found if found.n_processes > 1 else None
    return None


def initialize(n_processes=None, host0_address=None, host0_port=None, process_id=None,
               n_local_devices=None):
    """Start ``jax.distributed`` when this process is one of several; return its :class:`Cluster`.

    Must run before anything touches a JAX backend. With no arguments and no multi-process
    environment this does nothing, so a single-process script stays single-process.
    ``n_local_devices`` (or ``REDCOAST_N_LOCAL_DEVICES``) sets the number of CPU devices of this
    process; on accelerators every visible device is used.
    """
    if n_local_devices is None and os.environ.get(ENV_N_LOCAL_DEVICES):
        n_local_devices = _env_int(os.environ, ENV_N_LOCAL_DEVICES, minimum=1)
    if n_local_devices is not None:
        _set_cpu_device_count(n_local_devices)
    if jax.distributed.is_initialized():
        return None
    cluster = detect(n_processes, host0_address, host0_port, process_id)
    if cluster is None:
        return None
    _use_gloo_on_cpu()
    timeouts = {name: _env_int(os.environ, name, default, minimum=1)
                for name, default in TIMEOUT_DEFAULTS.items()}
    kwargs = dict(initialization_timeout=timeouts[ENV_INIT_TIMEOUT],
                  heartbeat_timeout_seconds=timeouts[ENV_HEARTBEAT_TIMEOUT],
                  shutdown_timeout_seconds=timeouts[ENV_SHUTDOWN_TIMEOUT])
    if cluster.jax_detection is not None:
        kwargs["cluster_detection_method"] = cluster.jax_detection
    else:
        # Everything is known: keep JAX from filling the rest from SLURM / MPI variables.
        kwargs.update(coordinator_address=cluster.coordinator, num_processes=cluster.n_processes,
                      process_id=cluster.process_id, cluster_detection_method="deactivate")
        if cluster.local_device_ids is not None:
            kwargs["local_device_ids"] = list(cluster.local_device_ids)
    init_timeout = timeouts[ENV_INIT_TIMEOUT]
    me = "" if cluster.process_id is None else f"process {cluster.process_id} of "
    fix = (f"Fix: start all {cluster.n_processes} processes within {init_timeout} s of each other "
           f"({ENV_INIT_TIMEOUT} raises the limit), with the same coordinator address and port "
           "and distinct process ids; make sure process 0 runs on that host, that the port is "
           "free there and open to every host (firewall), and look in the other processes' logs "
           "for an earlier error.")
    if cluster.process_id not in (None, 0):
        _wait_for_coordinator(cluster, init_timeout, f"{me}{cluster.n_processes}", fix)
    # JAX ends the process (a C++ fatal error) if the others do not join in time: say first
    # what it was waiting for, so the log explains the abort.
    hint = threading.Timer(min(30.0, init_timeout / 2), lambda: print(
        f"redcoast: {me}{cluster.n_processes} ({cluster.source}) is still waiting for the other "
        f"processes to join jax.distributed at {cluster.coordinator or 'the detected address'}; "
        f"it gives up after {init_timeout} s. {fix}", file=sys.stderr, flush=True))
    hint.daemon = True
    hint.start()
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:  # JAX's message is a gRPC status; say what it means for this run
        raise ConfigError(
            f"{me}{cluster.n_processes} ({cluster.source}) could not start jax.distributed with "
            f"the coordinator at {cluster.coordinator or 'the detected address'}: "
            f"{str(e).strip().splitlines()[0][:300]}\n{fix}") from e
    finally:
        hint.cancel()
    _exit_at_once_on_error()
    return cluster


def describe(cluster):
    """One line for the log: how this run's processes were found."""
    if cluster is None:
        return "single process"
    return (f"{cluster.n_processes} processes from {cluster.source}, coordinator "
            f"{cluster.coordinator or '(detected by JAX)'}")


def _wait_for_coordinator(cluster, timeout, who, fix):
    """Return once process 0's coordinator accepts connections, or raise a clear error."""
    host, _, port = cluster.coordinator.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"{who} ({cluster.source}) could not reach the coordinator (process 0) at "
                    f"{cluster.coordinator} within {timeout} s: {e}.\n{fix}") from None
        time.sleep(0.25)


# -- where the layout comes from -------------------------------------------------------------

def _from_arguments(n_processes, host0_address, host0_port, process_id):
    if (n_processes or 1) <= 1 and host0_address is None:
        return None
    missing = [name for name, value in [("n_processes", n_processes),
                                        ("host0_address", host0_address),
                                        ("process_id", process_id)] if value is None]
    if missing:
        raise ConfigError(
            f"A multi-process run was asked for but {', '.join(missing)} was not given. Fix: pass "
            "n_processes, host0_address, host0_port and process_id to Deployer together "
            "(or none of them, for one process or to detect redcoast launch, SLURM, Open MPI or "
            "a TPU pod).")
    n, pid = _check_ids(n_processes, process_id, "n_processes", "process_id")
    port = DEFAULT_PORT if host0_port is None else _check_port(host0_port, "host0_port")
    return Cluster("Deployer arguments", n, pid, f"{_host(host0_address)}:{port}")


def _from_redcoast_env(env, host0_port):
    missing = [v for v in (ENV_PROCESS_ID, ENV_HOST0_ADDRESS) if not env.get(v)]
    if missing:
        raise ConfigError(
            f"{ENV_N_PROCESSES} is set but {', '.join(missing)} is not. Fix: start the processes "
            f"with `redcoast launch -n N script.py`, or set all of {ENV_N_PROCESSES}, "
            f"{ENV_PROCESS_ID}, {ENV_HOST0_ADDRESS} (and {ENV_HOST0_PORT}) for every process.")
    n = _env_int(env, ENV_N_PROCESSES, minimum=1)
    pid = _env_int(env, ENV_PROCESS_ID, minimum=0)
    n, pid = _check_ids(n, pid, ENV_N_PROCESSES, ENV_PROCESS_ID)
    if n == 1:
        return None
    port = _coordinator_port(env, host0_port, default=DEFAULT_PORT)
    local = None
    if env.get(ENV_LOCAL_PROCESS_ID) and env.get(ENV_N_LOCAL_DEVICES):
        # Several processes on one machine split its accelerators (ignored on CPU).
        k = _env_int(env, ENV_N_LOCAL_DEVICES, minimum=1)
        first = _env_int(env, ENV_LOCAL_PROCESS_ID, minimum=0) * k
        local = tuple(range(first, first + k))
    return Cluster("redcoast launch", n, pid, f"{_host(env[ENV_HOST0_ADDRESS])}:{port}", local)


def _from_slurm(env, host0_port):
    """One process per task of an ``srun`` step. A shell inside an allocation (``salloc``, an
    interactive step, a batch script not under ``srun``) is not a step of several tasks."""
    if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env:
        return None
    if "SLURM_STEP_NUM_TASKS" not in env and "SLURM_STEP_NODELIST" not in env:
        return None  # job-level variables only: not started by srun
    n = _env_int(env, "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS",
                 default=1, minimum=1)
    if n <= 1:
        return Cluster("SLURM", 1, 0, None)
    pid = _env_int(env, "SLURM_PROCID", minimum=0)
    n, pid = _check_ids(n, pid, "SLURM_NTASKS", "SLURM_PROCID")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if env.get(ENV_HOST0_ADDRESS):
        host = env[ENV_HOST0_ADDRESS]
    elif nodes:
        host = first_slurm_host(nodes)
    else:
        raise ConfigError(
            "SLURM started this process as one of several tasks but gave no node list "
            "(SLURM_STEP_NODELIST / SLURM_JOB_NODELIST). Fix: set REDCOAST_HOST0_ADDRESS to the "
            "address of the node that runs task 0.")
    job = _env_int(env, "SLURM_JOB_ID", minimum=0)
    step = int(env["SLURM_STEP_ID"]) if env.get("SLURM_STEP_ID", "").isdigit() else 0
    port = _coordinator_port(env, host0_port, default=_ephemeral_port(job * 31 + step))
    nodes_var = "SLURM_STEP_NUM_NODES" if env.get("SLURM_STEP_NUM_NODES") else "SLURM_NNODES"
    n_nodes = _env_int(env, nodes_var, default=1, minimum=1)
    local = _one_device_per_local_task(env, env.get("SLURM_LOCALID"), n > n_nodes)
    return Cluster("SLURM", n, pid, f"{_host(host)}:{port}", local)


def _from_open_mpi(env, host0_port):
    if "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    n = _env_int(env, "OMPI_COMM_WORLD_SIZE", minimum=1)
    if n <= 1:
        return Cluster("Open MPI", 1, 0, None)
    pid = _env_int(env, "OMPI_COMM_WORLD_RANK", minimum=0)
    n, pid = _check_ids(n, pid, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
    # mpirun's own address: Open MPI <= 4 publishes it in OMPI_MCA_orte_hnp_uri, Open MPI 5
    # (PRRTE / PMIx) in PMIX_SERVER_URI*; rank 0 runs on that host unless told otherwise.
    uri_vars = ["OMPI_MCA_orte_hnp_uri"] + sorted(k for k in env if k.startswith("PMIX_SERVER_URI"))
    uri = next((env[k] for k in uri_vars if env.get(k)), "")
    match = re.search(r"tcp4?://(?:\[([^\]]+)\]|([^,:;/]+))|tcp6://\[([^,\]]+)", uri)
    if env.get(ENV_HOST0_ADDRESS):
        host = env[ENV_HOST0_ADDRESS]
    elif match:
        host = next(g for g in match.groups() if g)
    else:
        raise ConfigError(
            "Open MPI started this process as one of several ranks, but the address of the host "
            "that ran mpirun was not found (no OMPI_MCA_orte_hnp_uri or PMIX_SERVER_URI*). Fix: "
            "pass the address of rank 0's host, e.g. `mpirun -x REDCOAST_HOST0_ADDRESS=10.0.0.1 "
            "...`.")
    job = env.get("OMPI_MCA_orte_hnp_uri", "").split(".", 1)[0]
    key = int(job) // 2**12 if job.isdigit() else zlib.crc32(
        (env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or uri).encode())
    port = _coordinator_port(env, host0_port, default=_ephemeral_port(key))
    local_size = _env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", default=1, minimum=1)
    local = _one_device_per_local_task(env, env.get("OMPI_COMM_WORLD_LOCAL_RANK"), local_size > 1)
    return Cluster("Open MPI", n, pid, f"{_host(host)}:{port}", local)


def _from_cloud_tpu(env, host0_port):
    """A cloud TPU pod (GCE or GKE), found by JAX's own detection, which also finds the rest."""
    try:
        from jax._src import cloud_tpu_init
        if not cloud_tpu_init.running_in_cloud_tpu_vm:
            return None
        from jax._src.clusters import GceTpuCluster, GkeTpuCluster
    except (ImportError, AttributeError):  # another JAX version: leave detection to JAX
        return None
    for cls in (GkeTpuCluster, GceTpuCluster):
        if cls.is_env_present():
            return Cluster("cloud TPU", cls.get_process_count(), None, None,
                           jax_detection=cls.name)
    return None


# -- helpers ----------------------------------------------------------------------------------

def first_slurm_host(node_list):
    """The first host name of a SLURM node list: ``'gpu[07-09,12],cpu3'`` -> ``'gpu07'``."""
    out, i = [], 0
    while i < len(node_list) and node_list[i] != ",":
        if node_list[i] == "[":
            end = node_list.index("]", i)
            out.append(re.split(r"[-,]", node_list[i + 1:end])[0])
            i = end + 1
        else:
            out.append(node_list[i])
            i += 1
    return "".join(out).strip()


def _one_device_per_local_task(env, local_id, shared_node):
    """``(local_id,)`` when several tasks share a node and nothing has split its GPUs yet."""
    if not shared_node or local_id is None or not str(local_id).isdigit():
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES") or env.get("ROCR_VISIBLE_DEVICES")
    if visible is not None and len(visible.split(",")) <= 1:
        return None  # the scheduler already gave this task its own device
    return (int(local_id),)


def _ephemeral_port(key):
    """A port every process derives alike from the job's id (as JAX does): 61440..65535."""
    return 65535 - 2**12 + 1 + int(key) % 2**12


def _coordinator_port(env, host0_port, default):
    if host0_port is not None:
        return _check_port(host0_port, "host0_port")
    for name in (ENV_HOST0_PORT, "JAX_COORDINATOR_PORT"):
        if env.get(name):
            return _check_port(_env_int(env, name, minimum=1), name)
    return default


def _host(address):
    address = str(address).strip()
    if ":" in address and not address.startswith("["):  # a bare IPv6 address
        return f"[{address}]"
    return address


def _check_port(port, name):
    try:
        port = int(port)
    except (TypeError, ValueError):
        port = -1
    if not 0 < port < 65536:
        raise ConfigError(f"{name}={port!r} is not a port number. Fix: use a free TCP port "
                          "between 1024 and 65535 on process 0's host.")
    return port


def _check_ids(n, pid, n_name, pid_name):
    if not isinstance(n, int) or not isinstance(pid, int) or n < 1 or not 0 <= pid < n:
        raise ConfigError(
            f"{pid_name}={pid!r} with {n_name}={n!r}: every process needs a distinct id in "
            f"0..{n_name}-1. Fix: number the processes 0, 1, ..., n-1 and give all of them the "
            "same process count.")
    return n, pid


def _env_int(env, name, default=None, minimum=None):
    raw = env.get(name)
    if raw is None or str(raw).strip() == "":
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        value = None
    if value is None or (minimum is not None and value < minimum):
        raise ConfigError(f"The environment variable {name}={raw!r} is not a whole number"
                          f"{'' if minimum is None else f' >= {minimum}'}. Fix: set it to one, "
                          "or unset it.")
    return value


def _use_gloo_on_cpu():
    """CPU collectives between processes need gloo; recent JAX picks it, older JAX did not."""
    try:
        if jax.config.jax_cpu_collectives_implementation in (None, "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError, KeyError):
        pass


_exit_hook_installed = False


def _exit_at_once_on_error():
    """An uncaught error ends this process right after its traceback is printed; a clean end
    says so in ``REDCOAST_RETURNED_FILE`` (under ``redcoast launch``).

    Otherwise JAX's exit handler waits at a shutdown barrier for peers that may be blocked in a
    collective with this very process (up to the shutdown timeout). Exiting lets ``redcoast
    launch`` (or, under SLURM / MPI, JAX's heartbeat on the other processes) stop the run. A
    clean end still waits there (the others may be about to finish too), but the launcher,
    told the script has returned, can name this process if the others are still working long
    after. Handlers registered after ``initialize`` (log files, TensorBoard, W&B) still run first.
    """
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    _exit_hook_installed = True
    failed = []
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        failed.append(130 if issubclass(kind, KeyboardInterrupt) else 1)
        previous(kind, value, tb)

    def exit_now():
        returned = os.environ.get(ENV_RETURNED_FILE)
        if returned and not failed:
            try:
                open(returned, "a").close()
            except OSError:  # the launcher is gone; nothing to tell
                pass
        if failed:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # a closed stream must not hide the exit code
                    pass
            os._exit(failed[0])

    sys.excepthook = excepthook
    atexit.register(exit_now)  # runs before JAX's own exit handler (registered at import)


def _set_cpu_device_count(n_local_devices):
    """Ask for ``n_local_devices`` CPU devices in this process (effective only before JAX starts)."""
    try:
        n_local_devices = int(n_local_devices)
        if n_local_devices < 1:
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"n_local_devices={n_local_devices!r}; it must be a positive integer.")
    try:
        jax.config.update("jax_num_cpu_devices", n_local_devices)
    except RuntimeError as e:  # the backend is already running
        if jax.default_backend() == "cpu" and len(jax.local_devices()) != n_local_devices:
            raise ConfigError(
                f"n_local_devices={n_local_devices} was asked for, but JAX had already started "
                f"with {len(jax.local_devices())} local devices. Fix: create the Deployer before "
                "any other JAX call, or set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{n_local_devices} before starting Python.") from e
    else:
        # The same count in XLA_FLAGS (an inherited other one would fight it), and the flags
        # that keep simulated devices from deadlocking or timing out each other.
        simulate_cpu_devices(n_local_devices)
