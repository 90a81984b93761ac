"""redcoast's per-user cache. JAX's persistent compilation cache is on by default: a second run of the same script takes its
compiled programs from the cache (JAX's own cache-hit events count them) and computes the same."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from redcoast import user_cache

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
