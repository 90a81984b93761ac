"""Operations JAX lowers with the devices in hand (redcoast/sharding/device_bound.py): a custom
partitioning rule, as cuDNN's attention has, and host callbacks, told from the rest."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning

from redcoast.sharding.device_bound import device_bound, holds_device_bound


@custom_partitioning
def _kernel(q, k, v):
    return q


_kernel.def_partition(  # a rule of its own (traced here, never lowered): operands as they come
    partition=lambda mesh, args, result: (mesh, lambda q, k, v: q, result.sharding,
                                          [a.sharding for a in args]),
    infer_sharding_from_operands=lambda mesh, args, result: args[0].sharding,
    sharding_rule="b t h d, b s k e, b s k f -> b t h d")


def vendor_attention(q, k, v, **kwargs):
    """Attention with a partitioning rule of its own, as cuDNN's."""
    return _kernel(q, k, v)


def equations(fn, *args):
    return list(jax.make_jaxpr(fn)(*args).jaxpr.eqns)


def test_a_custom_partitioning_rule_and_a_host_callback_need_the_devices():
    x = jnp.ones((2, 4, 3, 8))
    (vendor,) = equations(vendor_attention, x, x, x)
    assert device_bound(vendor)
    (host,) = equations(lambda a: jax.pure_callback(np.tanh, jax.ShapeDtypeStruct(a.shape, a.dtype), a), x)
    assert device_bound(host)


def test_jaxs_operations_an_ffi_call_and_random_keys_do_not():
    # XLA partitions jax's own operations; an FFI call it hands its operands whole (no crash)
    x = jnp.ones((2, 4, 3, 8))
    program = jax.make_jaxpr(lambda a: jax.jit(jax.nn.relu)(
        jnp.split(a @ a.swapaxes(-1, -2), 2, axis=1)[0]).sum()
        + jax.random.normal(jax.random.PRNGKey(0))
        + jax.ffi.ffi_call("kernel", jax.ShapeDtypeStruct((), a.dtype))(a))(x)
    assert not any(map(device_bound, program.jaxpr.eqns)) and not holds_device_bound(program)


def test_one_held_inside_a_custom_derivative_and_a_jitted_call_is_found():
    # cuDNN's attention is a custom VJP whose primal holds the call
    x = jnp.ones((2, 4, 3, 8))
    wrapped = jax.custom_vjp(lambda q, k, v: vendor_attention(q, k, v))
    wrapped.defvjp(lambda q, k, v: (vendor_attention(q, k, v), None), lambda _, g: (g, g, g))
    program = jax.make_jaxpr(lambda a: jax.jit(wrapped)(a, a, a).sum())(x)
    assert device_bound(program.jaxpr.eqns[0]) and holds_device_bound(program)
