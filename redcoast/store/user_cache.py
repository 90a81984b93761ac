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
JAX, keep it where only you can write. JAX bounds it to ``MAX_BYTES``, least recently used
entries evicted first, with the ``filelock`` package (a dependency of redcoast; without it,
installed with ``--no-deps``, JAX cannot evict and the cache grows until deleted, said in the log).

Several environments (virtualenvs, jax versions) may share the cache: JAX's key holds its
version and compression, so each reads only what it can. What JAX's eviction cannot read is
repaired once, under JAX's own lock, before the first compilation (:func:`repair_entries`):
an entry without its ``-atime`` record (written by an environment that did not bound the cache,
or by a process killed while writing) is checked and given one, a damaged one removed; the log
says so in one line. JAX up to 0.11 otherwise fails every write that evicts with a warning.
"""

import os
import zlib

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
    repaired = repair_entries(directory) if bounded else ""
    jax.config.update("jax_compilation_cache_dir", directory)
    size = (f"at most {MAX_BYTES / 2**30:.0f} GiB, least recently used evicted" if bounded else
            "unbounded: the filelock package, a dependency of redcoast, is missing, so JAX "
            "cannot evict old entries. Fix: pip install filelock")
    return directory, (f"compiled steps are cached in {directory} ({size}; {ENV}=off turns "
                       f"it off){repaired}")


def _filelock_available():
    """JAX needs the ``filelock`` package to bound (evict from) the cache (and imports it as
    here: jax/_src/lru_cache.py)."""
    try:
        import filelock  # noqa: F401
    except ImportError:
        return False
    return True


CACHE_SUFFIX, ATIME_SUFFIX = "-cache", "-atime"  # JAX's names (jax/_src/lru_cache.py)
LOCK_NAME = ".lockfile"  # the lock JAX's bounded cache takes around every read and write
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame; JAX writes zlib where it has no zstd
CHUNK = 1 << 20


def repair_entries(directory, lock_timeout_s=10.0):
    """Make every entry of the compilation cache in ``directory`` one JAX's eviction can read:
    an entry with no ``-atime`` record (written by an environment that did not bound the cache,
    or cut short by a killed process) is given one (its file's modification time) if it
    decompresses, and removed if it does not; a record without its entry is removed. Done under
    JAX's lock. Returns what was done as the end of a log line ("" if nothing was)."""
    import filelock

    try:
        with filelock.FileLock(os.path.join(directory, LOCK_NAME), timeout=lock_timeout_s):
            given, removed, orphans = _repair_unlocked(directory)
    except filelock.Timeout:
        return (f"; the cache's lock was held for {lock_timeout_s:.0f} s by another process, "
                "so entries other environments wrote were not checked this time")
    except OSError as e:  # a cache that cannot be repaired still caches: said, not fatal
        return f"; its entries could not be checked ({type(e).__name__}: {e})"
    parts = []
    if given:
        parts.append(f"{given} entr{'y' if given == 1 else 'ies'} written without an access "
                     "record (by an environment without filelock, or an older redcoast) given one")
    if removed:
        parts.append(f"{removed} damaged entr{'y' if removed == 1 else 'ies'} (cut short or "
                     "unreadable) removed")
    if orphans:
        parts.append(f"{orphans} access record{'' if orphans == 1 else 's'} without an entry "
                     "removed")
    return "; " + ", ".join(parts) if parts else ""


def _repair_unlocked(directory):
    """(entries given an access record, damaged entries removed, orphaned records removed)."""
    given = removed = orphans = 0
    names = set(os.listdir(directory))
    for name in sorted(names):
        path = os.path.join(directory, name)
        if name.endswith(ATIME_SUFFIX):
            if name[:-len(ATIME_SUFFIX)] + CACHE_SUFFIX not in names:
                os.remove(path)
                orphans += 1
            continue
        if not name.endswith(CACHE_SUFFIX):
            continue
        atime = path[:-len(CACHE_SUFFIX)] + ATIME_SUFFIX
        if os.path.exists(atime):
            continue
        if entry_is_readable(path):
            with open(atime, "wb") as f:  # what JAX writes: nanoseconds, little-endian
                f.write(os.stat(path).st_mtime_ns.to_bytes(8, "little"))
            given += 1
        else:
            os.remove(path)
            removed += 1
    return given, removed, orphans


def entry_is_readable(path):
    """Whether the compressed entry at ``path`` decompresses, whole, to more than JAX's 4-byte
    time header. A zstd entry where this Python has no zstd decoder counts as readable: another
    environment wrote it for itself (JAX's key holds the compression), and it is left alone."""
    with open(path, "rb") as f:
        if f.read(len(ZSTD_MAGIC)) == ZSTD_MAGIC:
            f.seek(0)
            decompressor = _zstd_decompressor()
            return True if decompressor is None else _decompresses(decompressor, f)
        f.seek(0)
        return _decompresses(zlib.decompressobj(), f)


def _zstd_decompressor():
    """A zstd decompressor object (``decompress``, ``eof``), or None without a decoder."""
    try:
        from compression import zstd  # Python 3.14+
        return zstd.ZstdDecompressor()
    except ImportError:
        pass
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard.ZstdDecompressor().decompressobj()


def _decompresses(decompressor, f):
    """Whether the stream in ``f`` decompresses to its end marker with nothing after it, to
    more than 4 bytes (read a chunk at a time: entries may be large)."""
    size = 0
    try:
        while chunk := f.read(CHUNK):
            if decompressor.eof:
                return False  # bytes after the end of the stream
            size += len(decompressor.decompress(chunk))
    except Exception:  # noqa: BLE001 - zlib.error, zstd's own errors: damaged data
        return False
    return decompressor.eof and size > 4 and not getattr(decompressor, "unused_data", b"")
