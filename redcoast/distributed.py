"""Starting JAX's multi-process runtime (``jax.distributed``) from explicit arguments."""

import jax

from .errors import ConfigError

DEFAULT_PORT = 11111


def initialize(n_processes=None, host0_address=None, host0_port=None, process_id=None,
               n_local_devices=None):
    """Start ``jax.distributed`` when the arguments ask for several processes.

    Must run before anything touches a JAX backend. With no arguments this does nothing, so a
    single-process script stays single-process. ``n_local_devices`` sets the number of CPU
    devices of this process (simulated devices); on accelerators every local device is used.
    """
    if n_local_devices is not None:
        _set_cpu_device_count(n_local_devices)
    if (n_processes or 1) <= 1 and host0_address is None:
        return
    if jax.distributed.is_initialized():
        return
    missing = [name for name, value in [("n_processes", n_processes),
                                        ("host0_address", host0_address),
                                        ("process_id", process_id)] if value is None]
    if missing:
        raise ConfigError(
            f"A multi-process run was asked for but {', '.join(missing)} was not given. Fix: pass "
            "n_processes, host0_address, host0_port and process_id to Deployer together "
            "(or none of them for a single process).")
    # CPU collectives between processes need gloo; recent JAX picks it by default, older did not.
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError, KeyError):
        pass
    port = DEFAULT_PORT if host0_port is None else host0_port
    jax.distributed.initialize(coordinator_address=f"{host0_address}:{port}",
                               num_processes=n_processes, process_id=process_id)


def _set_cpu_device_count(n_local_devices):
    """Ask for ``n_local_devices`` CPU devices in this process (effective only before JAX starts)."""
    try:
        jax.config.update("jax_num_cpu_devices", int(n_local_devices))
    except RuntimeError as e:  # the backend is already running
        if jax.default_backend() == "cpu" and len(jax.local_devices()) != n_local_devices:
            raise ConfigError(
                f"n_local_devices={n_local_devices} was asked for, but JAX had already started "
                f"with {len(jax.local_devices())} local devices. Fix: create the Deployer before "
                "any other JAX call, or set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{n_local_devices} before starting Python.") from e
