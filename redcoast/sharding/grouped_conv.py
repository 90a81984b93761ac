"""A guard for grouped convolutions, whose gradient XLA's SPMD partitioner gets wrong.

A convolution with ``feature_group_count > 1`` (depthwise and grouped convolutions: ResNeXt,
RegNet, ConvNeXt, MobileNet blocks, a speech encoder's positional convolution) whose input is
split over 'dp' and replicated over 'mp', with its kernel replicated, comes back from
``jax.grad`` with size('mp') times its true kernel gradient (measured on jax 0.10.2 and 0.12.0.1,
CPU: 4.000 on a 2 x 4 mesh, 2.000 on 4 x 2, right on 8 x 1 and 1 x 8; ungrouped convolutions are
right). The loss is right, so nothing fires: the run just drifts from the one-device run.
Per-example gradients of any convolution (``vmap`` of ``grad``, as DATA_AXIS-SGD computes them) are
grouped convolutions too, the examples folded into the groups: on a data-parallel 8 x 1 mesh
they come back wrong altogether (relative error 0.97 on jax 0.10.2; right on 4 x 2, 2 x 4 and
1 x 8), which the layout check of examples/dp_sgd found.

:func:`guard_grouped_convs` runs each such convolution of a function under ``shard_map`` on the
mesh: the input split over 'dp' along its batch axis (as redcoast's batches are), the kernel
whole, the convolution computed locally (one whose batch does not divide, or holds its groups, is
computed whole on every device: right, if slower). The partitioner never sees it, and the
kernel's gradient is the sum over the data shards that ``shard_map``'s own differentiation
writes. The rest of the program is left as traced.

Where the plan splits a grouped convolution's channels over 'mp' by whole groups (the data-flow
analysis does when the shards divide its groups), gathering its kernel and input into the
``shard_map`` would undo the split. Left to the partitioner, such a convolution's gradient is
right when its input is split over 'mp' on its feature axis (wrong, size('mp') x again, when the
input is replicated over 'mp'; jax 0.10.2, CPU, 2 x 4 and 4 x 2), but the partitioner all-gathers
its kernel over 'mp', and in the backward pass its activations (a RegNet block: 1.64x Megatron's
bytes). So the guard writes it as one batched matmul per kernel tap with the groups split over
'mp' (group_matmuls.py): each device convolves its own groups, exactly Megatron's bytes (a
RegNet block: 1.00x). A ``shard_map`` over the split channels moved the same bytes but gave
gradients 1-4% off in a two-block-per-stage RegNet with BatchNorm on 2 x 4 (right with
``--xla_backend_optimization_level=0`` or ``--xla_disable_hlo_passes=algsimp``: an XLA miscompile;
jax 0.10.2, CPU), so it is not used. The guard recognises a kernel by the parameter it carries
(weight_origins.py).
"""

import warnings

import jax
from jax.sharding import PartitionSpec as P

from . import weight_origins
from .axes import DATA_AXIS, MODEL_AXIS
from .group_matmuls import conv_by_group_matmuls, split_groups_pin
from .interpreter import PER_DEVICE, bind, sub_programs, total
from .paths import leaves_with_paths

CONV = "conv_general_dilated"


def is_grouped_conv(eqn):
    """Whether ``eqn`` is a convolution with feature or batch groups."""
    return eqn.primitive.name == CONV and (eqn.params["feature_group_count"] > 1
                                           or eqn.params["batch_group_count"] > 1)


def _grouped(eqn, found_in):
    if is_grouped_conv(eqn):
        return [eqn]
    if eqn.primitive.name in PER_DEVICE:  # the user's own shard_map: never partitioned
        return []
    return [conv for _, _, sub in sub_programs(eqn) for conv in found_in(sub)]


def grouped_convs(jaxpr):
    """The grouped convolutions of ``jaxpr`` (a Jaxpr or ClosedJaxpr) and of every program it
    holds, except those inside a ``shard_map`` (computed per device, never partitioned)."""
    return total(jaxpr, _grouped, start=[])


def channels_split(eqn, kernel_origin, mesh, model_axis=MODEL_AXIS):
    """Whether ``eqn``'s grouped convolution runs with its channels split over ``model_axis``:
    the plan splits its kernel's output axis over every model shard (``kernel_origin``: the
    parameter the kernel carries, weight_origins.py, or None) and the shards divide its groups."""
    n = mesh.shape.get(model_axis, 1)
    o_axis = eqn.params["dimension_numbers"].rhs_spec[0]
    return (n > 1 and kernel_origin is not None and eqn.params["batch_group_count"] == 1
            and eqn.params["feature_group_count"] % n == 0 and kernel_origin.split_along([o_axis]))


def _conv_on_mesh(eqn, lhs, rhs, mesh, batch_axis):
    """``eqn``'s convolution under ``shard_map``: the input split over ``batch_axis`` along its
    batch dimension where that divides (a batch-grouped convolution, whose batch holds its
    groups, and an indivisible batch run whole), the kernel whole."""
    dn = eqn.params["dimension_numbers"]
    b_in, b_out = dn.lhs_spec[0], dn.out_spec[0]
    split = (eqn.params["batch_group_count"] == 1
             and lhs.shape[b_in] % mesh.shape[batch_axis] == 0)

    def spec(ndim, axis):
        return P(*[batch_axis if d == axis and split else None for d in range(ndim)])

    def local(x, k):
        if split:  # the kernel meets a per-device input: mark it so (shard_map checks)
            k = _varying(k, batch_axis)
        return bind(eqn, [x, k])[0]

    out_ndim = eqn.outvars[0].aval.ndim
    return jax.shard_map(local, mesh=mesh, in_specs=(spec(lhs.ndim, b_in), P()),
                         out_specs=spec(out_ndim, b_out))(lhs, rhs)


def _conv_on_split_channels(eqn, lhs, rhs, mesh, batch_axis):
    """``eqn``'s convolution, its channels split by whole groups over the model shards, as one
    batched matmul per kernel tap with the groups split over 'mp' (group_matmuls.py): each device
    convolves its own groups, and the partitioner, which gets batched matmuls right, has no
    grouped convolution to gather or to get wrong."""
    return conv_by_group_matmuls(eqn, lhs, rhs, pin=split_groups_pin(mesh, MODEL_AXIS, batch_axis))


def _varying(x, axis):
    """``x`` (the same on every device along ``axis``) typed as varying along it."""
    if hasattr(jax.lax, "pcast"):  # jax >= 0.10
        return jax.lax.pcast(x, (axis,), to="varying")
    return jax.lax.pvary(x, (axis,))


def _run_guarded(jaxpr, consts, args, mesh, batch_axis, arg_origins=None):
    """Run ``jaxpr`` with its grouped convolutions guarded (see the module docstring);
    ``arg_origins``: the parameter each of ``args`` carries, or None (weight_origins.py)."""
    def guarded(eqn, vals, ins):
        if is_grouped_conv(eqn):
            guard = _conv_on_split_channels if channels_split(eqn, ins[1], mesh) else _conv_on_mesh
            return [guard(eqn, *vals, mesh, batch_axis)]
        return None

    def enters(program):
        return bool(grouped_convs(program))

    def opaque(eqn):  # custom_vjp / custom_jvp: their derivative is the user's own rule
        warnings.warn(
            f"a grouped convolution (feature_group_count > 1) inside '{eqn.primitive.name}' "
            "cannot be guarded by redcoast; XLA's partitioner may return its kernel gradient "
            "multiplied by the number of model shards. Check the layout with "
            "trainer.check_layout(examples), or use n_model_shards=1.", stacklevel=7)

    return weight_origins.run_with_origins(jaxpr, consts, args,
                                           arg_origins or [None] * len(jaxpr.invars),
                                           guarded, enters, opaque)


def guard_grouped_convs(fn, mesh, batch_axis=DATA_AXIS, plan=None):
    """``fn`` with every grouped convolution it traces run under ``shard_map`` on ``mesh``, so
    that its gradient is right under the partitioner (see the module docstring); ``fn``'s
    arguments and results are pytrees of arrays. ``plan`` (a RewritePlan, rewrite_plan.py, of
    ``fn``'s first argument, the parameters): where it splits a grouped kernel's output channels
    by whole groups, the convolution runs on the split channels; without it, every kernel is
    used whole. On one device, ``fn`` itself."""
    if mesh.size == 1:
        return fn

    def guarded(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat_args = jax.tree_util.tree_leaves(args)
        origins = [None] * len(flat_args)
        if plan is not None and plan.knows_placements:  # the parameters are the first leaves
            params = leaves_with_paths(args[0])
            origins[:len(params)] = weight_origins.of_weights(plan.leaf_splits(params))
        outs = _run_guarded(closed.jaxpr, closed.consts, flat_args, mesh, batch_axis, origins)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
    return guarded
