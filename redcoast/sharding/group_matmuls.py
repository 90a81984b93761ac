"""A grouped convolution written as one batched matmul per kernel tap, batched over its groups.

``conv_general_dilated`` with ``feature_group_count=G`` equals, for each tap of its window, a
strided slice of the (padded, dilated) input times that tap of the kernel, contracted over each
group's input channels with the groups as a batch dimension, summed over the taps. Written so,
a convolution whose channels are split by whole groups over the model shards is a batched
``dot_general`` split on its batch axis: each device convolves its own groups and nothing
crosses the model shards, in the forward pass and in the backward one. XLA's SPMD partitioner
gathers the kernel and activations of the convolution itself over the model shards instead
(grouped_conv.py); these are the same FLOPs, with the taps' slices of the input materialised.
"""

import itertools

import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P


def _inverse(perm):
    """The permutation that undoes ``perm``."""
    return tuple(sorted(range(len(perm)), key=perm.__getitem__))


def conv_by_group_matmuls(eqn, lhs, rhs, pin=None):
    """``eqn``'s convolution (feature groups, no batch groups) of ``lhs`` by ``rhs`` as per-tap
    batched matmuls over its groups. ``pin(x)``: called on the input and on the summed output,
    both laid out ``[batch, groups, ...]``, to constrain their sharding; None leaves it to the
    compiler."""
    p = eqn.params
    if p["batch_group_count"] != 1:
        raise ValueError("conv_by_group_matmuls: batch-grouped convolutions are not rewritten")
    dn, groups = p["dimension_numbers"], p["feature_group_count"]
    x = jnp.transpose(lhs, dn.lhs_spec)  # [N, C, *S]
    w = jnp.transpose(rhs, dn.rhs_spec)  # [O, C/G, *K]
    n = x.shape[0]
    o, cg = w.shape[:2]
    og = o // groups
    zero = jnp.zeros((), x.dtype)
    config = [(0, 0, 0), (0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in
                                       zip(p["padding"], p["lhs_dilation"])]
    x = lax.pad(x, zero, config)
    x = x.reshape(n, groups, cg, *x.shape[2:])  # [N, G, C/G, *S']
    if pin is not None:
        x = pin(x)
    window = [(k - 1) * d + 1 for k, d in zip(w.shape[2:], p["rhs_dilation"])]
    out_sizes = [(s - k) // st + 1 for s, k, st in zip(x.shape[3:], window, p["window_strides"])]
    w = w.reshape(groups, og, cg, *w.shape[2:])  # [G, O/G, C/G, *K]
    # taps summed in float32 at least, as a convolution accumulates (bfloat16 inputs)
    accumulate = p["preferred_element_type"]
    if accumulate is None and jnp.issubdtype(x.dtype, jnp.floating):
        accumulate = jnp.promote_types(x.dtype, jnp.float32)
    total = None
    for tap in itertools.product(*(range(k) for k in w.shape[3:])):
        starts = [t * d for t, d in zip(tap, p["rhs_dilation"])]
        limits = [s + (m - 1) * st + 1 for s, m, st in zip(starts, out_sizes, p["window_strides"])]
        piece = lax.slice(x, (0, 0, 0, *starts), (n, groups, cg, *limits),
                          (1, 1, 1, *p["window_strides"]))  # [N, G, C/G, *Out]
        # contract C/G, batch over G: [G, N, *Out, O/G]
        term = lax.dot_general(piece, w[(Ellipsis, *tap)], (((2,), (2,)), ((1,), (0,))),
                               precision=p["precision"],
                               preferred_element_type=accumulate)
        total = term if total is None else total + term
    y = jnp.moveaxis(total, -1, 2)  # [G, N, O/G, *Out]
    y = jnp.swapaxes(y, 0, 1)  # [N, G, O/G, *Out]
    if pin is not None:
        y = pin(y)
    y = y.reshape(n, o, *out_sizes)
    return jnp.transpose(y, _inverse(dn.out_spec)).astype(eqn.outvars[0].aval.dtype)


def split_groups_pin(mesh, model_axis, batch_axis):
    """A ``pin`` for :func:`conv_by_group_matmuls`: of ``[batch, groups, ...]``, the groups over
    ``model_axis`` and the batch over ``batch_axis`` where it divides."""
    def pin(x):
        batch = batch_axis if x.shape[0] % mesh.shape[batch_axis] == 0 else None
        return lax.with_sharding_constraint(x, NamedSharding(mesh, P(batch, model_axis)))
    return pin
