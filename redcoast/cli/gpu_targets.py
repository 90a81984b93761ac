"""NVIDIA GPUs that ``redcoast plan`` compiles for without one: the GPU compiler itself, run here.

JAX's CUDA plugin compiles for a GPU that is not attached when it is given the GPU's description
(XLA's ``GpuTargetConfigProto``: SMs, shared memory, memory size, compute capability, ...) and
a topology (``jax.experimental.topologies``: slices x hosts x GPUs a host). Each description
lives in ``redcoast/cli/targets/<name>.json`` with where each number comes from; this module turns
one into the compiler's text format and into compile-only devices.
"""

import importlib.metadata
import json
import os

from ..errors import PlanError

TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")
MAX_GPUS_A_HOST = 8  # an HGX/DGX server's


def names():
    """The GPUs described in ``redcoast/cli/targets``, e.g. ``('a100', 'a100-40gb', 'h100', 'h200')``."""
    return tuple(sorted(f[:-len(".json")] for f in os.listdir(TARGETS_DIR) if f.endswith(".json")))


def description(name):
    """The description of GPU ``name`` (a dict: ``device_kind``, ``gpu_device_info``, ...)."""
    with open(os.path.join(TARGETS_DIR, f"{name}.json")) as f:
        return json.load(f)


def device_memory_bytes(name):
    """What the driver reports as GPU ``name``'s memory, in bytes."""
    return int(description(name)["gpu_device_info"]["device_memory_size"])


def target_config_text(desc):
    """``desc`` as a ``GpuTargetConfigProto`` in protobuf text format, what
    ``topologies.get_topology_desc(platform="cuda", target_config=...)`` reads."""
    def fields(values, indent):
        lines = []
        for key, value in values.items():
            if isinstance(value, dict):
                lines += [f"{indent}{key} {{", *fields(value, indent + "  "), f"{indent}}}"]
            else:
                lines.append(f"{indent}{key}: {json.dumps(value)}")
        return lines
    return "\n".join(fields({"gpu_device_info": desc["gpu_device_info"], "platform_name": "CUDA",
                             "dnn_version_info": desc["dnn_version_info"],
                             "device_description_str": desc["device_kind"]}, "")) + "\n"


def cuda_plugin(jax_version):
    """``(package, version)`` of the installed JAX CUDA plugin; a PlanError saying what to install
    when there is none, or none for this jax."""
    installed = {}
    for package in CUDA_PLUGINS:
        try:
            installed[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    install = (f"pip install 'jax[cuda12]=={jax_version}' (or 'jax[cuda13]=={jax_version}'; on a "
               "machine without a GPU it only compiles, no driver needed)")
    if not installed:
        raise PlanError(f"a GPU target compiles with JAX's GPU compiler, whose CUDA plugin is not "
                        f"installed. Fix: {install}, or --target cpu (XLA:CPU standing in).")
    for package, version in installed.items():
        if version == jax_version:
            return package, version
    found = ", ".join(f"{p} {v}" for p, v in installed.items())
    raise PlanError(f"a GPU target needs the CUDA plugin of the installed jax {jax_version}; found "
                    f"{found}. Fix: {install}.")


def compile_only_devices(name, devices, hosts, jax_version):
    """``(devices, what compiles for them)``: ``devices`` GPUs ``name`` on ``hosts`` hosts
    (``devices / hosts`` a host), described to JAX's GPU compiler; none need be here."""
    if name not in names():
        raise PlanError(f"no GPU target {name!r}: use one of {names()}")
    per_host = devices // hosts
    if devices % hosts or not 1 <= per_host <= MAX_GPUS_A_HOST:
        raise PlanError(
            f"--target {name} with {devices} GPUs on {hosts} host(s): a GPU server holds 1 to "
            f"{MAX_GPUS_A_HOST} GPUs, the same number on each host. Fix: --hosts so that "
            f"--devices / --hosts is at most {MAX_GPUS_A_HOST} (e.g. --devices {devices} --hosts "
            f"{max(1, -(-devices // MAX_GPUS_A_HOST))}).")
    package, version = cuda_plugin(jax_version)
    # the plugin's version check calls cuInit, which fails without a driver, and the 'cuda'
    # platform is then never registered; compiling needs neither driver nor GPU
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies
    desc = description(name)
    topology = f"1x{hosts}x{per_host}"
    try:
        described = topologies.get_topology_desc(platform="cuda", topology=topology,
                                                 target_config=target_config_text(desc))
    except NotImplementedError as e:  # 'topology not implemented for cuda': not registered
        raise PlanError(
            f"--target {name}: JAX's CUDA plugin ({package} {version}) is installed but was not "
            "started in this process: JAX started its backends before the GPU target was asked "
            "for, and the plugin's driver check (cuInit) failed then, with no GPU here. Fix: set "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (or JAX_PLATFORMS=cpu) before this process first "
            "uses jax, or plan from the command line (redcoast plan), which does.") from e
    except Exception as e:  # noqa: BLE001 - whatever the plugin says, said with the fix
        raise PlanError(
            f"--target {name}: JAX's CUDA plugin ({package} {version}) did not describe "
            f"{devices} {desc['device_kind']} GPUs (topology {topology}): {e}. Fix: reinstall "
            f"it at jax's version (pip install 'jax[cuda12]=={jax_version}'), or --target cpu.") from e
    return list(described.devices), (
        f"the GPU compiler (XLA:GPU through {package} {version}, jax {jax_version}) for "
        f"{devices} x {desc['device_kind']} ({per_host} a host, compute capability "
        f"{_capability(desc)}), described to it: none of them here")


def _capability(desc):
    cc = desc["gpu_device_info"]["cuda_compute_capability"]
    return f"{cc['major']}.{cc.get('minor', 0)}"
