"""Stacked layers' weights kept split into the scan that runs them, one layer gathered at a time.

The training step gathers each parameter FSDP stores split over 'dp' where the loss starts
(steps.gathered: one all-gather per parameter, its gradient one reduce-scatter). For a stack of
layers run by ``jax.lax.scan`` (redcoast's models with ``scan_layers=True``, Flax's ``nn.scan``,
any ``lax.scan`` over stacked weights) that gathers every layer at once: on OPT-66B over 64 TPU
v4 chips (dp=16 x mp=4, seq 512, remat) the TPU compiler asked for 104.66 GiB of temporaries and
refused the step. Kept as stored into the scan, each iteration takes its layer still split
(pinned so where the body takes it) and gathers it where it is used (pinned as computed there:
inside the body's remat, so that what the backward pass keeps of a rematerialised layer is the
split slice, and it gathers the layer again): the same step compiled in 9.67 GiB of temporaries
with the first pin alone, its peak 21.2 GiB, 21.4 GiB with both (pinned gathered where the body
takes it, outside the remat, the gathered layers were kept for the backward pass: 47.52 GiB).

Pinned only as stored, the partitioner was left to choose where to gather, and spread the
layer's split onto the activations instead: the hidden state in the loop split over 'dp' along
its features, every device computing the whole batch, and a norm scale split over all devices
put the hidden state over all eight (dp=2 x mp=4; seen on jax 0.10.2 and 0.11.2) -- on jax
0.11.2 the partitioner then aborted the process (a CHECK in its scatter of the embedding
gradient).

:func:`gather_layer_by_layer` does this for the parameters that a scan takes as scanned inputs
whole (the parameter itself, possibly cast or constrained, its leading axis the loop's); every
other parameter, and every other use, is left as traced.
"""

import jax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from . import grouped_axes, weight_origins
from .interpreter import (CALLS, REMATS, bind, called, evaluate, follow, opened, rerun_inside,
                          scan_operand_groups)


def scanned_leaves(closed, weights):
    """The indices of the parameter leaves (the first ``len(weights)`` inputs of ``closed``, a
    ClosedJaxpr; ``weights``: their rewrite_plan.WeightSplits) that some scan of ``closed``
    (or of a jit inside it) takes whole as a scanned input."""
    index = {w.path: i for i, w in enumerate(weights)}
    found = set()

    def scans(eqn, ins):
        if eqn.primitive.name == "scan":
            found.update(index[o.weight.path] for _, o in _scanned_weights(eqn, ins))
        elif eqn.primitive.name in CALLS:
            follow(called(eqn), ins, scans)
        return weight_origins.through(eqn, ins)

    n = len(weights)
    follow(closed.jaxpr, weight_origins.of_weights(weights) + [None] * (len(closed.jaxpr.invars) - n),
           scans)
    return found


def _scanned_weights(eqn, ins):
    """``[(operand index, Origin)]``: the scanned inputs of the scan ``eqn`` that are a
    parameter whole (``ins``: its operands' origins), the parameter's leading axis the loop's."""
    n_consts, n_carry, _ = scan_operand_groups(eqn)
    return [(k, o) for k, o in enumerate(ins) if k >= n_consts + n_carry and o is not None
            and o.axes == tuple(range(len(o.weight.shape)))]


def gather_layer_by_layer(fn, mesh, weights, layer_specs):
    """``fn(params, *rest)`` with the body of every scan that takes a parameter leaf ``i`` of
    ``layer_specs`` (``{leaf index: (stored, computed)}``, one layer's PartitionSpecs) whole as
    a scanned input constraining that input to its stored split where the body takes it and to
    its computed one where the body uses it: the layer is gathered inside the loop, one layer
    at a time. ``weights``: the WeightSplits of ``params``' leaves."""
    def rewritten(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat = jax.tree_util.tree_leaves(args)
        origins = weight_origins.of_weights(weights) + [None] * (len(flat) - len(weights))
        outs = _run_layer_by_layer(closed.jaxpr, closed.consts, flat, origins, mesh, weights, layer_specs)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
    return rewritten


def _run_layer_by_layer(jaxpr, consts, args, arg_origins, mesh, weights, layer_specs):
    index = {w.path: i for i, w in enumerate(weights)}
    origins = weight_origins.propagate(jaxpr, arg_origins)

    def layer_by_layer(eqn, vals):
        ins = [weight_origins.of(origins, v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "scan":
            specs = {k: layer_specs[index[o.weight.path]] for k, o in _scanned_weights(eqn, ins)
                     if index[o.weight.path] in layer_specs}
            return bind(eqn, vals, dict(eqn.params, jaxpr=_constrained_body(
                eqn.params["jaxpr"], specs, mesh))) if specs else None
        if name in CALLS:
            return rerun_inside(eqn, vals, lambda j, c, a: _run_layer_by_layer(j, c, a, ins, mesh, weights,
                                                                     layer_specs))
        return None

    return evaluate(jaxpr, args, layer_by_layer, consts=consts)


def _constrained_body(closed, specs, mesh):
    """The scan body ``closed`` with its inputs ``k`` of ``specs`` (``(stored, computed)``)
    constrained to their stored spec where the body takes them and to their computed spec
    where they are used."""
    def body(*args):
        args = [_pinned(a, mesh, specs[k][0]) if k in specs else a for k, a in enumerate(args)]
        used = {closed.jaxpr.invars[k]: spec[1] for k, spec in specs.items()}
        return run_gathering(closed.jaxpr, closed.consts, args, used, mesh)
    return jax.make_jaxpr(body)(*[v.aval for v in closed.jaxpr.invars])


def _pinned(x, mesh, spec):
    # a computed spec may split over groups of the model shards ('mp:4': K/V heads kept by the
    # shards of their query heads), which only grouped_axes' factored mesh names
    return jax.lax.with_sharding_constraint(x, grouped_axes.named_sharding(mesh, P(*spec)))


def run_gathering(jaxpr, consts, args, used, mesh):
    """``jaxpr`` evaluated on ``args``, each variable of ``used`` (``{Var: computed spec}``)
    constrained to its spec where an equation reads it; calls and rematerialised bodies that
    read one are entered, so that the gather is rematerialised with the body."""
    gathered = {}

    def read(v, x):
        if isinstance(v, jcore.Var) and v in used:
            if v not in gathered:  # one constraint, however many readers
                gathered[v] = _pinned(x, mesh, used[v])
            return gathered[v]
        return x

    def gathering(eqn, vals):
        name = eqn.primitive.name
        reads = [isinstance(v, jcore.Var) and v in used for v in eqn.invars]
        if not (any(reads) and name in CALLS | REMATS):
            return bind(eqn, [read(v, x) for v, x in zip(eqn.invars, vals)])
        sub, sub_consts = opened(called(eqn))
        if sub.constvars and not sub_consts:
            raise NotImplementedError(
                f"a '{name}' equation whose body has constants of its own, a form of JAX's "
                "programs redcoast does not know (sharding/scanned_weights.py)")
        inner = {iv: used[v] for v, iv, r in zip(eqn.invars, sub.invars, reads) if r}
        return rerun_inside(eqn, vals, lambda j, c, a: run_gathering(j, c, a, inner, mesh),
                            in_context=True)

    outs = evaluate(jaxpr, args, gathering, consts=consts)
    return [read(v, x) for v, x in zip(jaxpr.outvars, outs)]
