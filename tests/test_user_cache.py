"""redcoast's per-user cache. JAX's persistent compilation cache is on by default: a second run of the same script takes its
compiled programs from the cache (JAX's own cache-hit events count them) and computes the same."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from redcoast.store import user_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if name.endswith("/cache_hits") else None)
    from redcoast import Deployer
    deployer = Deployer(jax_seed=0, verbose=False)
    # JAX caches what took a second or more to compile; this small program takes less
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    @jax.jit
    def step(w, x):
        for _ in range(8):
            x = jnp.tanh(x @ w)
        return jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)

    w = jax.random.normal(deployer.gen_rng(), (64, 64))
    out = step(w, jnp.ones((16, 64)))
    print(json.dumps({"dir": deployer.compilation_cache_dir, "hits": len(hits),
                      "out": float(jnp.abs(out).sum())}))
""")



def run_script(env):
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_run_compiles_from_the_cache_and_computes_the_same(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    env.pop(user_cache.ENV, None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    first, second = run_script(env), run_script(env)
    assert first["dir"] == second["dir"] == str(tmp_path / "redcoast" / "jax")
    assert os.listdir(first["dir"])  # entries were written
    assert first["hits"] == 0 and second["hits"] >= 1
    assert second["out"] == first["out"]

    # JAX's own setting wins over redcoast's default
    mine = run_script({**env, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine")})
    assert mine["dir"] == str(tmp_path / "mine") and os.listdir(mine["dir"])


@pytest.mark.parametrize("environ, expected", [
    ({"HOME": "/h"}, "/h/.cache/redcoast"),
    ({"HOME": "/h", "XDG_CACHE_HOME": "/c"}, "/c/redcoast"),
    ({"HOME": "/h", user_cache.ENV: "/d/cache"}, "/d/cache"),
    ({"HOME": "/h", user_cache.ENV: "off"}, None),
    ({"HOME": "/h", user_cache.ENV: "0"}, None),
])
def test_where_the_cache_is_kept(environ, expected, monkeypatch):
    monkeypatch.setenv("HOME", environ["HOME"])
    assert user_cache.root(environ) == expected


# Two environments sharing one cache: the first has no filelock (a virtualenv without torch), so
# neither JAX nor redcoast bounds the cache there and its entries have no `-atime` record; the
# second bounds it. Each compiles programs of its own (distinct shapes) and counts JAX's warnings.
TWO_ENVIRONMENTS = textwrap.dedent("""
    import json, sys, warnings
    without_filelock, max_size, first, count = json.loads(sys.argv[1])
    if without_filelock:
        sys.modules["filelock"] = None  # as if not installed: `import filelock` fails
    import jax, jax.numpy as jnp
    if max_size:
        jax.config.update("jax_compilation_cache_max_size", max_size)
    from redcoast import Deployer
    deployer = Deployer(jax_seed=0, verbose=False)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(first, first + count):
            jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0))(jnp.ones((n, 8))).block_until_ready()
    print(json.dumps({"dir": deployer.compilation_cache_dir,
                      "warnings": [str(w.message) for w in caught]}))
""")


def cache_entries(directory):
    names = os.listdir(directory)
    return ({n[:-len("-cache")]: os.path.getsize(os.path.join(directory, n))
             for n in names if n.endswith("-cache")},
            {n[:-len("-atime")] for n in names if n.endswith("-atime")})


@pytest.mark.slow  # two processes, 11 s
def test_entries_of_an_environment_without_filelock_are_repaired_once_and_evicted(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    env.pop(user_cache.ENV, None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)

    def run(without_filelock, max_size, first, count):
        out = subprocess.run([sys.executable, "-c", TWO_ENVIRONMENTS,
                              json.dumps([without_filelock, max_size, first, count])],
                             env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    unbounded = run(True, 0, 1, 4)
    directory = unbounded["dir"]
    foreign, atimes = cache_entries(directory)
    assert len(foreign) >= 4 and not atimes  # what JAX writes without filelock
    assert not unbounded["warnings"]

    # the bounded environment, with room for half as much again as there is: about as much as
    # the first run wrote, its writes evict the oldest (foreign) entries
    room = sum(foreign.values()) * 3 // 2
    bounded = run(False, room, 20, 4)
    assert bounded["dir"] == directory
    assert bounded["warnings"] == []  # before: "Error writing persistent compilation cache entry"
    entries, atimes = cache_entries(directory)
    assert set(entries) == atimes  # every entry has its record: JAX's eviction reads them all
    assert sum(entries.values()) <= room
    mine = [k for k in set(entries) - set(foreign) if k.startswith("jit__lambda")]
    assert len(mine) == 4  # every program of the bounded run was written
    assert set(foreign) - set(entries)  # the least recently used (foreign) were evicted


def zlib_entry(payload=b"\x00\x00\x00\x01" + b"x" * 1000):
    import zlib
    return zlib.compress(payload)


def test_repair_gives_readable_entries_a_record_and_removes_damaged_ones(tmp_path):
    whole = zlib_entry()
    (tmp_path / "a-cache").write_bytes(whole)                   # foreign, readable
    (tmp_path / "b-cache").write_bytes(whole[:len(whole) // 2])  # cut short by a kill
    (tmp_path / "c-cache").write_bytes(b"not compressed at all")  # damaged
    (tmp_path / "d-cache").write_bytes(whole)                   # the bounded cache's own
    (tmp_path / "d-atime").write_bytes((123).to_bytes(8, "little"))
    (tmp_path / "e-atime").write_bytes((5).to_bytes(8, "little"))  # its entry evicted
    (tmp_path / "f-cache").write_bytes(whole + b"trailing")     # bytes after the stream
    (tmp_path / "g-cache").write_bytes(user_cache.ZSTD_MAGIC + b"\0" * 40)  # zstd
    note = user_cache.repair_entries(str(tmp_path))
    names = sorted(os.listdir(tmp_path))
    has_zstd = user_cache._zstd_decompressor() is not None
    kept_g = [] if has_zstd else ["g-atime", "g-cache"]  # no decoder: another env's, kept
    assert names == sorted(["a-atime", "a-cache", "d-atime", "d-cache", ".lockfile"] + kept_g)
    mtime = os.stat(tmp_path / "a-cache").st_mtime_ns
    assert int.from_bytes((tmp_path / "a-atime").read_bytes(), "little") == mtime
    assert int.from_bytes((tmp_path / "d-atime").read_bytes(), "little") == 123  # untouched
    given = 1 + len(kept_g) // 2
    assert note == (f"; {given} entr{'y' if given == 1 else 'ies'} written without an access "
                    "record (by an environment without filelock, or an older redcoast) given "
                    f"one, {3 + (1 if has_zstd else 0)} damaged entries (cut short or unreadable) "
                    "removed, 1 access record without an entry removed")
    assert user_cache.repair_entries(str(tmp_path)) == ""  # once: nothing left to do
