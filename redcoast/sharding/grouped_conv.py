"""A guard for grouped convolutions, whose gradient XLA's SPMD partitioner gets wrong.

A convolution with ``feature_group_count > 1`` (depthwise and grouped convolutions: ResNeXt,
RegNet, ConvNeXt, MobileNet blocks, a speech encoder's positional convolution) whose input is
split over 'dp' and replicated over 'mp', with its kernel replicated, comes back from
``jax.grad`` with size('mp') times its true kernel gradient (measured on jax 0.10.2 and 0.12.0.1,
CPU: 4.000 on a 2 x 4 mesh, 2.000 on 4 x 2, right on 8 x 1 and 1 x 8; ungrouped convolutions are
right). The loss is right, so nothing fires: the run just drifts from the one-device run.
Per-example gradients of any convolution (``vmap`` of ``grad``, as DP-SGD computes them) are
grouped convolutions too, the examples folded into the groups: on a data-parallel 8 x 1 mesh
they come back wrong altogether (relative error 0.97 on jax 0.10.2; right on 4 x 2, 2 x 4 and
1 x 8), which the layout check of examples/dp_sgd found.

:func:`guard_grouped_convs` runs each such convolution of a function under ``shard_map`` on the
mesh: the input split over 'dp' along its batch axis (as redcoast's batches are), the kernel
whole, the convolution computed locally (one whose batch does not divide, or holds its groups, is
computed whole on every device: right, if slower). The partitioner never sees it, and the
kernel's gradient is the sum over the data shards that ``shard_map``'s own differentiation
writes. The rest of the program is left as traced.
"""

import warnings

import jax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from .jaxpr_tools import bind

CONV = "conv_general_dilated"
_INLINE = ("jit", "pjit", "closed_call", "core_call")
_REMAT = ("checkpoint", "remat", "remat2")
# bodies the partitioner never splits: the user's own shard_map is computed per device
_LOCAL = ("shard_map", "xla_pmap")


def is_grouped_conv(eqn):
    """Whether ``eqn`` is a convolution with feature or batch groups."""
    return eqn.primitive.name == CONV and (eqn.params["feature_group_count"] > 1
                                           or eqn.params["batch_group_count"] > 1)


def sub_jaxprs(eqn):
    """``[(param name, index or None, Jaxpr or ClosedJaxpr)]``: the programs ``eqn`` holds."""
    out = []
    for name, value in eqn.params.items():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for i, item in enumerate(items):
            if isinstance(item, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                out.append((name, i if isinstance(value, (tuple, list)) else None, item))
    return out


def _open(j):
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


def grouped_convs(jaxpr):
    """The grouped convolutions of ``jaxpr`` (a Jaxpr or ClosedJaxpr) and of every program it
    holds, except those inside a ``shard_map`` (computed per device, never partitioned)."""
    found = []
    for eqn in _open(jaxpr).eqns:
        if is_grouped_conv(eqn):
            found.append(eqn)
        elif eqn.primitive.name not in _LOCAL:
            for _, _, sub in sub_jaxprs(eqn):
                found.extend(grouped_convs(sub))
    return found


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


def _varying(x, axis):
    """``x`` (the same on every device along ``axis``) typed as varying along it."""
    if hasattr(jax.lax, "pcast"):  # jax >= 0.10
        return jax.lax.pcast(x, (axis,), to="varying")
    return jax.lax.pvary(x, (axis,))


def _evaluate(jaxpr, consts, args, mesh, batch_axis):
    """Run ``jaxpr`` with its grouped convolutions guarded (see the module docstring)."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        if is_grouped_conv(eqn):
            outs = [_conv_on_mesh(eqn, *vals, mesh, batch_axis)]
        elif eqn.primitive.name not in _LOCAL and any(grouped_convs(s) for _, _, s in sub_jaxprs(eqn)):
            outs = _guarded_call(eqn, vals, mesh, batch_axis)
        else:
            outs = bind(eqn, vals)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _guarded_closed(closed, mesh, batch_axis):
    """The same ClosedJaxpr with its grouped convolutions guarded."""
    def run(*args):
        return _evaluate(closed.jaxpr, closed.consts, args, mesh, batch_axis)
    return jax.make_jaxpr(run)(*[v.aval for v in closed.jaxpr.invars])


def _guarded_call(eqn, vals, mesh, batch_axis):
    """An equation holding a grouped convolution in a sub-program, run with it guarded."""
    name = eqn.primitive.name
    if name in _INLINE:
        sub = eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]
        if isinstance(sub, jcore.ClosedJaxpr):
            return _evaluate(sub.jaxpr, sub.consts, vals, mesh, batch_axis)
        return _evaluate(sub, (), vals, mesh, batch_axis)
    if name in _REMAT and isinstance(eqn.params.get("jaxpr"), jcore.Jaxpr):
        body = eqn.params["jaxpr"]  # rematerialised as before, guarded inside
        run = jax.checkpoint(lambda *a: _evaluate(body, (), a, mesh, batch_axis),
                             prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])
        with eqn.ctx.manager:
            return list(run(*vals))
    if name in ("scan", "while", "cond"):  # loop and branch bodies: ClosedJaxprs, replaced
        params = dict(eqn.params)
        for key, i, sub in sub_jaxprs(eqn):
            guarded = _guarded_closed(sub, mesh, batch_axis)
            if i is None:
                params[key] = guarded
            else:
                params[key] = tuple(guarded if j == i else s for j, s in enumerate(params[key]))
        return bind(eqn, vals, params)
    # custom_vjp / custom_jvp: their derivative is the user's own rule, out of redcoast's reach
    warnings.warn(
        f"a grouped convolution (feature_group_count > 1) inside '{name}' cannot be guarded by "
        "redcoast; XLA's partitioner may return its kernel gradient multiplied by the number of "
        "model shards. Check the layout with trainer.check_layout(examples), or use "
        "n_model_shards=1.", stacklevel=4)
    return bind(eqn, vals)


def guard_grouped_convs(fn, mesh, batch_axis="dp"):
    """``fn`` with every grouped convolution it traces run under ``shard_map`` on ``mesh``, so
    that its gradient is right under the partitioner (see the module docstring); ``fn``'s
    arguments and results are pytrees of arrays. On one device, ``fn`` itself."""
    if mesh.size == 1:
        return fn

    def guarded(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _evaluate(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves(args), mesh,
                         batch_axis)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
    return guarded
