"""Grouped and depthwise convolutions train as on one device, whatever the mesh.

XLA's SPMD partitioner returns a grouped convolution's kernel gradient multiplied by size('mp')
when its input is split over 'dp' and replicated over 'mp' (NOTES.md, 2026-11-25); redcoast's
batches are laid out exactly so. sharding/grouped_conv.py runs such convolutions under
shard_map. These tests fail where the guard is removed (as long as XLA has the defect).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import redcoast.layout.steps
from redcoast import Deployer, LayoutCheckError, Trainer
from redcoast.sharding.grouped_conv import grouped_convs, guard_grouped_convs

MESHES = [(2, 4), (4, 2), (8, 1)]
GROUPS = {"ordinary": 1, "grouped": 4, "depthwise": 8}


def conv(x, kernel, groups):
    return lax.conv_general_dilated(x, kernel, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
                                    feature_group_count=groups)


def plain(kernel, x, groups):
    return jnp.sum(jnp.tanh(conv(x, kernel, groups)) ** 2)


def rematerialised(kernel, x, groups):
    return jnp.sum(jnp.tanh(jax.checkpoint(lambda h: conv(h, kernel, groups))(x)) ** 2)


def scanned(kernel, x, groups):
    h, _ = lax.scan(lambda h, _: (jnp.tanh(conv(h, kernel, groups)), None), x, None, length=2)
    return jnp.sum(h ** 2)


def _mesh(shape):
    return Mesh(np.array(jax.devices()).reshape(shape), ("dp", "mp"))


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("groups", GROUPS.values(), ids=GROUPS.keys())
@pytest.mark.parametrize("loss", [plain, rematerialised, scanned], ids=lambda f: f.__name__)
def test_the_plain_jax_reproduction_guarded_gives_one_devices_gradient(loss, groups, shape):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 16, 8)).astype(np.float32)
    kernel = (rng.normal(size=(3, 8 // groups, 8)) * 0.3).astype(np.float32)
    expected = jax.grad(loss)(kernel, x, groups)
    mesh = _mesh(shape)
    shardings = (NamedSharding(mesh, P()), NamedSharding(mesh, P("dp")))
    guarded = guard_grouped_convs(lambda k, v: loss(k, v, groups), mesh)
    got = jax.jit(jax.grad(guarded), in_shardings=shardings)(kernel, x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("shape", [(8, 1), (4, 2), (2, 4)])
def test_per_example_convolution_gradients_guarded_equal_one_devices(shape):
    """vmap(grad) of a convolution (DP-SGD's per-example gradients) folds the examples into the
    groups of its kernel-gradient convolution: wrong altogether on 8 x 1 without the guard."""
    def loss(kernel, x):
        y = lax.conv_general_dilated(x[None], kernel, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(jnp.tanh(y) ** 2)

    def per_example(kernel, x):
        return jax.vmap(jax.grad(loss), in_axes=(None, 0))(kernel, x)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8, 8, 3)).astype(np.float32)
    kernel = (rng.normal(size=(3, 3, 3, 4)) * 0.3).astype(np.float32)
    expected = per_example(kernel, x)
    mesh = _mesh(shape)
    shardings = (NamedSharding(mesh, P()), NamedSharding(mesh, P("dp")))
    got = jax.jit(guard_grouped_convs(per_example, mesh), in_shardings=shardings)(kernel, x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_grouped_convolutions_are_found_inside_sub_programs_but_not_in_shard_map():
    x, k = jnp.ones((8, 16, 8)), jnp.ones((3, 2, 8))
    assert len(grouped_convs(jax.make_jaxpr(lambda a, b: scanned(a, b, 4))(k, x))) == 1
    assert len(grouped_convs(jax.make_jaxpr(lambda a, b: rematerialised(a, b, 4))(k, x))) == 1
    assert grouped_convs(jax.make_jaxpr(lambda a, b: plain(a, b, 1))(jnp.ones((3, 8, 8)), x)) == []
    mesh = _mesh((2, 4))
    local = jax.shard_map(lambda h, w: conv(h, w, 4), mesh=mesh, in_specs=(P("dp"), P()),
                          out_specs=P("dp"), check_vma=False)
    assert grouped_convs(jax.make_jaxpr(local)(x, k)) == []


class ConvNet(nn.Module):
    """A 1-D convolutional classifier: an ordinary, a grouped and a depthwise convolution."""

    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Conv(16, (3,), name="stem")(x))
        x = jnp.tanh(nn.Conv(16, (3,), feature_group_count=4, name="grouped")(x))
        x = jnp.tanh(nn.Conv(16, (5,), feature_group_count=16, name="depthwise")(x))
        return nn.Dense(3, name="head")(x.mean(1))


def _convnet_setup(n=32, seed=0):
    rng = np.random.default_rng(seed)
    examples = [{"x": rng.normal(size=(12, 6)).astype(np.float32), "y": int(rng.integers(0, 3))}
                for _ in range(n)]
    model = ConvNet()
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 12, 6)))["params"]

    def collate(batch):
        return {"x": np.stack([e["x"] for e in batch]), "y": np.array([e["y"] for e in batch])}

    def loss_fn(rng, state, params, batch, is_training):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return model, params, examples, collate, loss_fn


@pytest.mark.parametrize("n_model_shards", [4, 2], ids=["2x4", "4x2"])
def test_trainer_steps_on_grouped_convolutions_equal_one_device(n_model_shards):
    model, params, examples, collate, loss_fn = _convnet_setup()
    deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, verbose=False)
    trainer = Trainer(deployer, collate, model.apply, loss_fn, params, optax.sgd(0.5))
    per_device = 2
    global_batch = per_device * (8 // n_model_shards)
    report = trainer.check_layout(examples, per_device, rtol=1e-5)
    assert report.ok and report.compared == "gradients"
    trainer.fit(examples[:2 * global_batch], per_device, n_epochs=1, shuffle=False)

    def step(p, batch):  # the hand-written one-device reference
        grads = jax.grad(lambda q: loss_fn(None, trainer.state, q, batch, True))(p)
        return jax.tree_util.tree_map(lambda a, g: a - 0.5 * g, p, grads)
    expected = params
    for i in range(2):
        expected = jax.jit(step)(expected, collate(examples[i * global_batch:(i + 1) * global_batch]))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(trainer.params),
                                 jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_check_layout_finds_the_layout_without_the_guard(monkeypatch):
    """A deliberately broken layout (the guard removed, the partitioner's defect let through)
    is found and the wrong leaves are named. If this fails because nothing is found, XLA has
    fixed the defect on this jax: the guard may then be kept only for older versions. The
    kernels are kept replicated by rule, so that the convolutions' inputs are replicated over
    'mp', where the defect shows (with the plan's channel split they are right, see below)."""
    monkeypatch.setattr(redcoast.layout.steps, "guard_grouped_convs", lambda fn, mesh, **kw: fn)
    model, params, examples, collate, loss_fn = _convnet_setup()
    trainer = Trainer(Deployer(jax_seed=0, n_model_shards=4, verbose=False), collate, model.apply,
                      loss_fn, params, optax.sgd(0.5), params_sharding_rules=[((".*",), P())])
    with pytest.raises(LayoutCheckError, match="DIFFERS from one device") as info:
        trainer.check_layout(examples, 2)
    message = str(info.value)
    assert "gradient of grouped/kernel" in message and "gradient of depthwise/kernel" in message
    assert "gradient of stem/kernel" not in message  # the ordinary convolution is right


def test_a_channel_split_grouped_convolution_runs_as_matmuls_over_split_groups():
    """Where the plan splits a grouped kernel by groups over 'mp', the guard writes the
    convolution as batched matmuls over its groups, pinned split over 'mp' (group_matmuls.py),
    not gathered into a shard_map; a kernel the plan keeps whole still runs under the shard_map."""
    from redcoast.sharding.rewrite_plan import RewritePlan
    from redcoast.sharding.rules import Placement

    mesh = _mesh((2, 4))
    x, kernel = jnp.ones((8, 16, 16)), jnp.ones((3, 4, 16))

    def traced(spec):
        plan = RewritePlan.from_placements([Placement(("k",), kernel.shape, np.float32, spec, "")], mesh)
        guarded = guard_grouped_convs(lambda p, v: plain(p["k"], v, 4), mesh, plan=plan)
        return str(jax.make_jaxpr(guarded)({"k": kernel}, x))

    split = traced(P(None, None, "mp"))
    assert "shard_map" not in split and "conv_general_dilated" not in split
    assert "dot_general" in split and "sharding_constraint" in split and "'mp'" in split
    assert "shard_map" in traced(P())


@pytest.mark.parametrize("n_model_shards", [4, pytest.param(2, marks=pytest.mark.slow)],
                         ids=["2x4", "4x2"])
def test_a_speech_encoder_with_a_grouped_positional_conv_trains_as_on_one_device(n_model_shards):
    """wav2vec2's layout (tests/architectures.py's speech): strided convs split over their
    channels, a grouped positional conv kept whole (guarded), transformer layers split."""
    from architectures import speech
    arch = speech()
    examples = [{k: v[i] for k, v in arch.batch.items()} for i in range(len(arch.batch["audio"]))]
    trainer = Trainer(Deployer(jax_seed=0, n_model_shards=n_model_shards, verbose=False),
                      lambda rows: {k: np.stack([r[k] for r in rows]) for k in rows[0]}, None,
                      lambda rng, state, params, batch, is_training: arch.loss(params, batch),
                      arch.params, optax.sgd(0.1))
    report = trainer.check_layout(examples, len(examples) // (8 // n_model_shards), rtol=1e-5)
    assert report.ok and "gradient of pos_conv" in dict(report.errors)
