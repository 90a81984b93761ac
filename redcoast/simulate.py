"""Simulated CPU devices for laptops, tests and CI: N devices in one process.

JAX reads ``XLA_FLAGS`` when its backend starts (the first computation or ``jax.devices()``),
so call :func:`simulate_cpu_devices` before that, e.g. at the top of a script.
"""

import glob
import importlib.util
import mmap
import os
import warnings

#: The most simulated devices redcoast's commands start unasked (``--allow-many`` for more).
#: JAX's start grows faster than linearly with them (measured, jax 0.10.2 on 2 busy cores: 1024
#: devices 1.1 s, 4096 15 s, 16384 over 200 s), and XLA:CPU refused to compile for 4096 of them
#: ("Multiprocess computations aren't implemented on the CPU backend"). Real plans need fewer:
#: the README's rows go to 64 devices, a TPU v4 pod slice to 1024 chips (and a TPU target
#: compiles for its chips without simulating them).
MAX_SIMULATED_DEVICES = 1024

# Simulated devices run their programs, collectives included, on XLA's shared Eigen thread pool.
# With multi-threaded Eigen, a device's matmul can wait for pool threads that other devices hold
# while they wait for it at a collective: a deadlock, seen here on 2 cores with 8 devices (7 of 8
# threads at an all-gather, forever). Single-threaded Eigen avoids it and costs little when
# there are more simulated devices than cores.
_SAFE_FLAGS = {"xla_cpu_multi_thread_eigen": "false"}
# XLA aborts a CPU collective whose participants have not all arrived after 40 s. Eight
# simulated devices on two busy cores can be that late without anything being wrong.
_PATIENT_COLLECTIVES = {
    "xla_cpu_collective_call_warn_stuck_timeout_seconds": 120,
    "xla_cpu_collective_call_terminate_timeout_seconds": 900,
}


def simulate_cpu_devices(n_devices):
    """Give this process ``n_devices`` CPU devices that cannot deadlock or time out each other
    (a warning above :data:`MAX_SIMULATED_DEVICES`: JAX will be slow to start)."""
    if int(n_devices) > MAX_SIMULATED_DEVICES:
        warnings.warn(simulation_cost(n_devices) + "; expect a slow start", stacklevel=2)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={int(n_devices)}")
    for name, value in {**_SAFE_FLAGS, **_PATIENT_COLLECTIVES}.items():
        if not any(f.startswith(f"--{name}") for f in flags) and _jaxlib_knows_flag(name):
            flags.append(f"--{name}={value}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def _jaxlib_knows_flag(name):
    """Whether this jaxlib was built with XLA flag ``name`` (an unknown flag aborts XLA)."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return False
    needle = name.encode()
    for path in glob.glob(os.path.join(spec.submodule_search_locations[0], "*.so")):
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(needle) >= 0:
                    return True
        except (OSError, ValueError):
            continue
    return False


def simulation_cost(n_devices):
    """What simulating ``n_devices`` CPU devices costs, for a warning or a refusal."""
    return (f"{n_devices} simulated CPU devices in one process (XLA's "
            "--xla_force_host_platform_device_count): JAX's start grows faster than linearly "
            "with them (measured with jax 0.10.2: 1024 devices in about 1 s, 4096 in 15 s, 16384 "
            "in over 200 s), and XLA:CPU refused to compile for 4096")
