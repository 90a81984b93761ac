"""Parameters FSDP stores split, gathered inside the rematerialised layer that uses them.

The training step gathers each parameter FSDP stores split over 'dp' where the loss starts
(steps.gathered). An unrolled model whose layers are rematerialised (``remat=True``: each
layer a ``jax.checkpoint``) then takes every layer's gathered weights into its layer as
inputs, and the backward pass needs them again: all of them are kept from the forward pass to
the backward pass, a whole unsplit copy of the layers on every device (Llama-3-8B in float32:
26 GiB a device whatever the number of devices). Kept as stored up to the layer and gathered
inside its remat, a layer's weights are gathered where it runs and gathered again when the
backward pass recomputes it, as ZeRO-3 and FSDP do, and what is kept between the passes is
each device's split slice.

Measured on XLA:CPU (the plan's stand-in), Llama-3-8B's width (4096, 14336) over 8 devices at
4096 tokens with remat: 0.65 GiB of temporaries a layer instead of 0.97. Much of what stays is
the stand-in's own: XLA:CPU sums the gradients over 'dp' with one all-reduce of every layer's
full-size gradients at the end of the step (seen in a small Llama's compiled step: one
all-reduce of all its gradients, no reduce-scatter), so they are all alive at once there.

:func:`rematerialised_leaves` finds the parameters read whole only inside rematerialised bodies
(through calls); :func:`gather_in_remat` constrains each to its computed sharding where such a
body reads it (the rewrite of :mod:`redcoast.sharding.scanned_weights`, applied to the
program's own remat bodies). Every other parameter, and every other use, is left as traced.
"""

import jax

from . import weight_origins
from .interpreter import REMATS
from .scanned_weights import run_gathering


def rematerialised_leaves(closed, weights):
    """The indices of the parameter leaves (the first ``len(weights)`` inputs of ``closed``, a
    ClosedJaxpr; ``weights``: their rewrite_plan.WeightSplits) that ``closed`` reads only as
    a whole input of rematerialised bodies (or views of one: a cast, a sharding constraint)."""
    in_remat, elsewhere = set(), set()

    def use(eqn, read):
        for i, (_, o) in read.items():
            whole = eqn.primitive.name in REMATS and o.axes == tuple(range(len(o.weight.shape)))
            (in_remat if whole else elsewhere).add(i)

    weight_origins.visit_reads(closed, weights, use)
    return in_remat - elsewhere


def gather_in_remat(fn, mesh, computed):
    """``fn(params, *rest)`` with each parameter leaf ``i`` of ``computed`` (``{leaf index:
    spec}``, a PartitionSpec's tuple) constrained to that spec where the rematerialised bodies
    (and calls) of ``fn``'s program read it, not before: the caller passes those leaves as
    stored."""
    def rewritten(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat = jax.tree_util.tree_leaves(args)
        used = {closed.jaxpr.invars[i]: spec for i, spec in computed.items()}
        outs = run_gathering(closed.jaxpr, closed.consts, flat, used, mesh)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
    return rewritten


def gathered_in_remat(closed, weights, starts, compute_shardings, stored_shardings):
    """``(shardings the loss starts from, {leaf: computed spec})``: ``starts`` with the leaves
    :func:`rematerialised_leaves` finds in ``closed`` (the loss's program) that are stored
    otherwise than computed (FSDP) starting as stored, to be gathered by
    :func:`gather_in_remat`."""
    compute, treedef = jax.tree_util.tree_flatten(compute_shardings)
    stored = treedef.flatten_up_to(stored_shardings)
    begin = treedef.flatten_up_to(starts)
    moved = {i for i in rematerialised_leaves(closed, weights)
             if not stored[i].is_equivalent_to(compute[i], len(weights[i].shape))}
    if not moved:
        return starts, {}
    begin = [stored[i] if i in moved else s for i, s in enumerate(begin)]
    return (jax.tree_util.tree_unflatten(treedef, begin),
            {i: tuple(compute[i].spec) for i in moved})
