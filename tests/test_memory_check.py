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


# Each compiler's refusal of a step over its memory, word for word as recorded, so that a changed
# wording fails here and not for a user. libtpu 0.0.42.1 (the libtpu of jax[tpu]==0.10.2, CI
# step 1's jax): OPT-13B on 8 v4 chips, seq 1024, scanned, without remat (issue 46)
TPU_REFUSAL_LIBTPU_0_0_42 = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
                             "required for HLO temporaries (38.64G) exceeds available HBM "
                             "(30.75G).")
# libtpu 0.0.50.1 (jax 0.12.0.1): a 64 GiB argument summed on one v4 chip (jax.jit(lambda a:
# a.sum()) for f32[16384, 1048576]): the figure counts the arguments, not temporaries alone
TPU_REFUSAL_LIBTPU_0_0_50 = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on "
                             "HBM, the total memory required for HLO temporaries (64.00G) exceeds "
                             "available HBM (30.75G). HLO module: jit__lambda.\nSee "
                             "https://openxla.org/xla/errors/error_1000 for more details.")
# older libtpu, as XLA's page for error E1000 (openxla.org/xla/errors/error_1000) shows it
TPU_REFUSAL_USED_OF = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in "
                       "memory space hbm. Used 49.34G of 32.00G hbm. Exceeded hbm capacity by "
                       "17.34G.")
# neither refusals for memory: the GPU allocator at run time, the host's memory
NOT_REFUSALS = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 85899345920 bytes.",
                "RESOURCE_EXHAUSTED: out of host memory",
                "INTERNAL: ptxas exited with non-zero error code 65280")


@pytest.mark.parametrize("message, needed, available", [
    (TPU_REFUSAL_LIBTPU_0_0_42, 38.64, 30.75), (TPU_REFUSAL_LIBTPU_0_0_50, 64.00, 30.75),
    (TPU_REFUSAL_USED_OF, 49.34, 32.00)])
def test_each_compilers_refusal_is_read_as_the_bytes_it_asked_for(message, needed, available):
    from redcoast.layout.memory_check import compiler_refusal
    refusal = compiler_refusal(jax.errors.JaxRuntimeError(message))
    assert (refusal.needed_bytes, refusal.available_bytes) == (int(needed * 2**30),
                                                                int(available * 2**30))
    assert refusal.message == message.splitlines()[0]


@pytest.mark.parametrize("message", NOT_REFUSALS)
def test_other_compiler_errors_are_no_refusal(message):
    from redcoast.layout.memory_check import compiler_refusal
    assert compiler_refusal(jax.errors.JaxRuntimeError(message)) is None


def test_a_compiler_that_refuses_the_step_stops_the_run_with_the_memory_explained(monkeypatch):
    from redcoast.loop import step_meter

    def refuse(self, state, batch, key):  # what the TPU compiler does instead of returning
        raise jax.errors.JaxRuntimeError(TPU_REFUSAL_LIBTPU_0_0_42)
    monkeypatch.setattr(step_meter.StepMeter, "_compiled", refuse)
    t = trainer(budget=2**30)
    # the compiler's figure is the whole need (the state's arguments included), not state + it
    with pytest.raises(ConfigError, match=r"(?s)does not fit the device: it needs 38\.64 GiB.*"
                                          r"the compiler refused the step.*Nothing was trained"):
        t.fit(examples(), per_device_batch_size=4, n_epochs=1)
    assert int(t.state.step) == 0


def test_the_memory_check_runs_once_a_batch_shape_and_again_for_a_new_one(monkeypatch):
    # each train() call asks; the compiler's memory analysis of a 22-layer step took 0.12 s a
    # call, a stall before every epoch's first step, so a shape already found to fit is not
    # analysed again, and a new shape is
    from redcoast.layout.memory_check import StepMemory
    analysed = []
    real = StepMemory.of.__func__
    monkeypatch.setattr(StepMemory, "of", classmethod(
        lambda cls, compiled, state: analysed.append(1) or real(cls, compiled, state)))
    t = trainer(budget=8 * 2**20)
    t.fit(examples(), per_device_batch_size=1, n_epochs=3)
    assert len(analysed) == 1
    t.train(examples(), per_device_batch_size=2)  # a new batch shape, within the budget
    assert len(analysed) == 2
    with pytest.raises(ConfigError, match="does not fit the device"):
        t.train(examples(4 * 2048), per_device_batch_size=2048)  # activations of 8 MiB a device
    assert len(analysed) == 3
