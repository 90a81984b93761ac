"""A grouped convolution as per-tap batched matmuls over its groups (sharding/group_matmuls.py):
the same values and gradients as XLA's convolution, and, split by groups over the model shards,
a step that moves nothing between them (the convolution itself has its kernel gathered)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from redcoast.layout.comms import collective_report
from redcoast.sharding.group_matmuls import conv_by_group_matmuls, split_groups_pin

# (dimension numbers, input shape, kernel shape, strides, padding, lhs / rhs dilation, groups)
CASES = {
    "nhwc-same": (("NHWC", "HWIO", "NHWC"), (3, 9, 9, 8), (3, 3, 2, 16), (1, 1), "SAME", (1, 1), (1, 1), 4),
    "nchw-strided-dilated": (("NCHW", "OIHW", "NCHW"), (3, 8, 9, 9), (16, 4, 3, 3), (2, 1),
                             ((1, 2), (0, 1)), (1, 1), (1, 2), 2),
    "transposed-negative-pad": (("NHWC", "HWIO", "NHWC"), (3, 9, 9, 8), (3, 3, 1, 16), (1, 1),
                                ((2, 2), (-1, 1)), (2, 1), (1, 1), 8),
    "1d-depthwise-valid": (("NWC", "WIO", "NWC"), (3, 9, 8), (3, 1, 8), (3,), "VALID", (1,), (2,), 8),
    "other-output-layout": (("NHWC", "HWIO", "NCHW"), (3, 9, 9, 8), (3, 3, 2, 16), (2, 2), "SAME",
                            (1, 1), (1, 1), 4),
}


def _conv_and_eqn(case):
    dn, x_shape, k_shape, strides, padding, lhs_dil, rhs_dil, groups = case
    rng = np.random.default_rng(0)
    x = rng.normal(size=x_shape).astype(np.float32)
    kernel = rng.normal(size=k_shape).astype(np.float32)

    def conv(v, k):
        return lax.conv_general_dilated(v, k, strides, padding, lhs_dilation=lhs_dil,
                                        rhs_dilation=rhs_dil, dimension_numbers=dn,
                                        feature_group_count=groups)
    eqn, = [e for e in jax.make_jaxpr(conv)(x, kernel).eqns if e.primitive.name == "conv_general_dilated"]
    return conv, eqn, x, kernel


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_rewrite_equals_the_convolution_and_its_gradients(case):
    conv, eqn, x, kernel = _conv_and_eqn(case)

    def loss(f):
        return lambda v, k: jnp.sum(jnp.sin(f(v, k)))
    rewritten = lambda v, k: conv_by_group_matmuls(eqn, v, k)  # noqa: E731
    np.testing.assert_allclose(jax.jit(rewritten)(x, kernel), conv(x, kernel), rtol=1e-5, atol=1e-5)
    want = jax.jit(jax.grad(loss(conv), (0, 1)))(x, kernel)
    got = jax.jit(jax.grad(loss(rewritten), (0, 1)))(x, kernel)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def test_in_bfloat16_the_taps_are_summed_as_precisely_as_the_convolution_sums():
    """The taps are accumulated in float32 (as a convolution accumulates), so the result is no
    further from the float32 answer than bfloat16's own convolution."""
    conv, eqn, x, kernel = _conv_and_eqn(CASES["nhwc-same"])
    x16, k16 = jnp.asarray(x, jnp.bfloat16), jnp.asarray(kernel, jnp.bfloat16)
    eqn16, = [e for e in jax.make_jaxpr(conv)(x16, k16).eqns if e.primitive.name == "conv_general_dilated"]
    exact = conv(x16.astype(jnp.float32), k16.astype(jnp.float32))
    got = jax.jit(lambda v, k: conv_by_group_matmuls(eqn16, v, k))(x16, k16)
    assert got.dtype == jnp.bfloat16
    err = lambda y: float(jnp.max(jnp.abs(y.astype(jnp.float32) - exact)))  # noqa: E731
    assert err(got) <= 1.01 * err(conv(x16, k16))


def test_split_by_groups_over_the_model_shards_it_moves_nothing_between_them():
    """On 2 x 4 with the kernel split by groups over 'mp' and the input by its channels: the
    gradients equal one device's, and the compiled gradient step has no collective over 'mp'
    (only the kernel gradient's reduction over 'dp'). The convolution itself, laid out the same,
    gathers over 'mp'."""
    conv, eqn, x, kernel = _conv_and_eqn(CASES["nhwc-same"])
    x = np.concatenate([x] * 2)  # a batch the 2 data shards divide
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "mp"))
    shardings = (NamedSharding(mesh, P("dp", None, None, "mp")),
                 NamedSharding(mesh, P(None, None, None, "mp")))
    pin = split_groups_pin(mesh, "mp", "dp")

    def step(f):
        return jax.jit(jax.grad(lambda v, k: jnp.sum(jnp.tanh(f(v, k)) ** 2), (0, 1)),
                       in_shardings=shardings)
    rewritten = step(lambda v, k: conv_by_group_matmuls(eqn, v, k, pin=pin))
    want = jax.grad(lambda v, k: jnp.sum(jnp.tanh(conv(v, k)) ** 2), (0, 1))(x, kernel)
    for g, w in zip(rewritten(x, kernel), want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
    report = collective_report(rewritten.lower(x, kernel).compile(), mesh)
    assert report.wire_bytes(axis="mp") == 0 and report.wire_bytes(axis="all") == 0, report.summary()
    assert report.count("all-reduce", "dp") >= 1, report.summary()
    as_conv = collective_report(step(conv).lower(x, kernel).compile(), mesh)
    assert as_conv.wire_bytes(axis=("mp", "all", "mixed")) > 0, as_conv.summary()


def test_batch_grouped_convolutions_are_refused():
    x, k = jnp.ones((4, 5, 2)), jnp.ones((3, 2, 4))
    conv = lambda v, w: lax.conv_general_dilated(v, w, (1,), "SAME",  # noqa: E731
                                                 dimension_numbers=("NWC", "WIO", "NWC"),
                                                 batch_group_count=2)
    eqn, = jax.make_jaxpr(conv)(x, k).eqns
    with pytest.raises(ValueError, match="batch-grouped"):
        conv_by_group_matmuls(eqn, x, k)
