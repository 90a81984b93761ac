"""redcoast's per-user cache: JAX's compiled programs and the layouts runs chose, kept between runs.

A run compiles its training step (and, when choosing a layout, every candidate's) at the first
batch: minutes on a real model, on every run of a script being iterated on. Two things make the
next run start fast, both keyed so that a stale entry is never used:

- JAX's persistent compilation cache (``<root>/jax``; its key holds the program, the devices,
  the compiler options and the jax version), turned on at ``Deployer(...)`` unless the user has
  configured JAX's own (``jax_compilation_cache_dir`` or ``JAX_COMPILATION_CACHE_DIR``), which
  always wins;
- the layout a run chose (``<root>/layouts``, one small file per key; layout_memory.py), read
  when the workdir has none: a new workdir for the same model, batch, devices and options skips
  comparing the candidates. Single-process runs only: hosts do not share a home directory, and
  every process must take the same layout.

``<root>`` is ``$XDG_CACHE_HOME/redcoast`` (``~/.cache/redcoast``); ``REDCOAST_CACHE=/some/dir``
moves it and ``REDCOAST_CACHE=off`` turns both off. The compilation cache is trusted code: like
JAX, keep it where only you can write. With the ``filelock`` package installed (it comes with
huggingface_hub, datasets and torch) JAX bounds it to ``MAX_BYTES``, least recently used entries
evicted first; without it JAX cannot evict, and it grows until deleted.
"""

import importlib.util
import os

import jax

ENV = "REDCOAST_CACHE"
OFF = ("off", "0", "false", "no")
MAX_BYTES = 4 * 2**30


def root(environ=os.environ):
    """The cache's directory (None: turned off)."""
    chosen = environ.get(ENV, "").strip()
    if chosen.lower() in OFF:
        return None
    if chosen:
        return os.path.abspath(os.path.expanduser(chosen))
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "redcoast")


def layouts_directory(environ=os.environ):
    """Where chosen layouts are remembered across workdirs (None: off, or several processes)."""
    base = root(environ)
    if base is None or jax.process_count() > 1:
        return None
    return os.path.join(base, "layouts")


def enable_compilation_cache(environ=os.environ):
    """Turn JAX's persistent compilation cache on in ``<root>/jax``, unless the user configured
    JAX's (then it is left as it is) or turned redcoast's cache off.

    Returns ``(directory or None, what to say in the log)``. Process-wide by nature: JAX has one
    compilation cache per process, so this is the one setting redcoast makes outside a value it
    holds; it changes how fast a program compiles, never what it computes.
    """
    configured = jax.config.jax_compilation_cache_dir or environ.get("JAX_COMPILATION_CACHE_DIR")
    if configured:
        return configured, f"JAX's compilation cache in {configured} (as configured)"
    base = root(environ)
    if base is None:
        return None, f"JAX's compilation cache off ({ENV}={environ.get(ENV)})"
    directory = os.path.join(base, "jax")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as e:  # a read-only home: run without the cache, and say so
        return None, (f"JAX's compilation cache off: cannot create {directory} ({e}); set "
                      f"{ENV}=/a/writable/dir to keep compiled steps between runs")
    bounded = _filelock_available()
    if bounded and jax.config.jax_compilation_cache_max_size == -1:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    jax.config.update("jax_compilation_cache_dir", directory)
    size = (f"at most {MAX_BYTES / 2**30:.0f} GiB, least recently used evicted" if bounded else
            "unbounded: `pip install filelock` lets JAX evict old entries")
    return directory, (f"compiled steps are cached in {directory} ({size}; {ENV}=off turns "
                       "it off)")


def _filelock_available():
    """JAX needs the ``filelock`` package to bound (evict from) the cache."""
    return importlib.util.find_spec("filelock") is not None
