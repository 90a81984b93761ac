"""A training step that does not fit its device stops before the first step, with its memory
explained; one that fits trains as before."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from redcoast import ConfigError, Deployer, Trainer

WIDTH = 256


def examples(n=32):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=WIDTH).astype(np.float32), "y": np.float32(i % 2)} for i in range(n)]


def collate(rows):
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def loss(rng, state, params, batch, is_training):
    h = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def trainer(budget):
    params = {"w1": jnp.full((WIDTH, 4 * WIDTH), 0.01), "w2": jnp.full((4 * WIDTH,), 0.01)}
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False, memory_budget_bytes=budget)
    return Trainer(deployer, collate, None, loss, params, optax.adam(1e-3))


@pytest.mark.parametrize("budget, fix", [
    (300_000, "the state alone nearly fills the device"),  # ~0.4 MiB of state per device
    (2**20, "a smaller per_device_batch_size")])           # the state fits, the step (1.4 MiB) not
def test_a_step_over_the_device_memory_stops_before_the_first_step_and_says_why(budget, fix):
    t = trainer(budget)
    with pytest.raises(ConfigError, match=r"(?s)does not fit the device: it needs .* per "
                                          r"device \(layout .*parameters .*optimizer state.*"
                                          rf"temporaries.*Nothing was trained. Fix: {fix}"):
        t.fit(examples(), per_device_batch_size=4, n_epochs=1)
    assert int(t.state.step) == 0


def test_a_step_within_the_device_memory_trains_as_without_a_budget():
    fitted, free = trainer(budget=2**30), trainer(budget=None)
    for t in (fitted, free):
        t.fit(examples(), per_device_batch_size=4, n_epochs=1, shuffle=False)
    assert int(fitted.state.step) == int(free.state.step) > 0
    for a, b in zip(jax.tree_util.tree_leaves(fitted.params), jax.tree_util.tree_leaves(free.params)):
        np.testing.assert_array_equal(a, b)


# as libtpu 0.0.50.1 (jax 0.12.0.1) words it for OPT-66B on 64 v4 chips, unrolled into the scan
TPU_REFUSAL = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
               "memory required for HLO temporaries (104.66G) exceeds available HBM (30.75G). "
               "HLO module: jit_step.")


def test_a_compiler_that_refuses_the_step_stops_the_run_with_the_memory_explained(monkeypatch):
    from redcoast import step_meter
    from redcoast.memory_check import refused_temporaries
    assert refused_temporaries(RuntimeError(TPU_REFUSAL)) == int(104.66 * 2**30)
    assert refused_temporaries(RuntimeError("RESOURCE_EXHAUSTED: out of host memory")) is None

    def refuse(self, state, batch, key):  # what the TPU compiler does instead of returning
        raise jax.errors.JaxRuntimeError(TPU_REFUSAL)
    monkeypatch.setattr(step_meter.StepMeter, "_compiled", refuse)
    t = trainer(budget=2**30)
    with pytest.raises(ConfigError, match=r"(?s)does not fit the device: it needs 104\.6. GiB.*"
                                          r"the compiler refused the step.*Nothing was trained"):
        t.fit(examples(), per_device_batch_size=4, n_epochs=1)
    assert int(t.state.step) == 0
