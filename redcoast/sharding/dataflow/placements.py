"""The entry points: a placement per parameter leaf from a function's data flow, or the reason
the analysis could not follow it (then the caller keeps the shape rules)."""

import math

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from .. import kv_repeat
from ..auto import model_width
from ..axes import MODEL_AXIS
from ..context import laid_out_for
from ..grouped_axes import grouped
from ..paths import leaves_in_written_order, leaves_with_paths
from ..rules import Placement
from . import control, gathers, layout_ops, products
from .analysis import Analysis
from .values import DataflowError

# {primitive name: rule(flow, eqn, ins)}; an operation without one is elementwise or unknown
RULES = {**layout_ops.RULES, **gathers.RULES, **products.RULES, **control.RULES}


def kv_head_groups(analysis):
    """{leaf: (parameter axis, groups)} for the K/V weights the plan replicates because their
    heads do not divide the shards, but whose output is repeated per query head (Llama's
    ``repeat_kv``, ``jnp.repeat``: head-major, so a KV head's query heads are consecutive and
    live on consecutive shards). Such a weight is split over ``gcd(heads, shards)`` groups of
    shards (grouped_axes.py), each group keeping the heads its query heads read. Every matmul
    that reads the weight must be such a projection, else it stays replicated."""
    n = analysis.n
    found, uses = {}, {}
    for eqn, weights in analysis.weight_of.items():
        for leaf, _ in weights:  # a function called with several weights: one eqn, each leaf
            uses.setdefault(leaf, set()).add(eqn)
    for jaxpr in analysis.jaxprs.values():
        for _, plan in kv_repeat.find_repeats(jaxpr, lambda shape, axes: False):
            groups = math.gcd(plan["heads"], n)
            if groups == 1 or (plan["heads"] * plan["groups"]) % n:
                continue
            for leaf, axes in analysis.weight_of.get(plan["dot"], ()):
                pa = axes[plan["weight_axis"]]
                if pa is not None and analysis.placement(leaf)[0] is None:
                    found.setdefault(leaf, {})[plan["dot"]] = (pa, groups)
    out = {}
    for leaf, by_dot in found.items():
        choices = set(by_dot.values())
        if set(by_dot) == uses.get(leaf) and len(choices) == 1:
            out[leaf] = choices.pop()
    return out


def abstract_tree(tree):
    def to_sds(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
        return x
    return jax.tree_util.tree_map(to_sds, tree)


def dataflow_placements(fn, params, *example_args, n_model_shards, group_kv_heads=True,
                        link_costs=None):
    """One :class:`Placement` per leaf of ``params`` (written order), from ``fn``'s data flow.

    ``fn(params, *example_args)`` is any function of the parameters — the forward pass or the
    loss; the args may be arrays or ``jax.ShapeDtypeStruct``s (nothing is computed). With
    ``group_kv_heads``, K/V with fewer heads than shards are split over groups of shards (see
    :func:`kv_head_groups`), else replicated. ``link_costs`` (a recurrent.LinkCosts, the
    platform's): a recurrent cell is split by hidden units where that pays by them
    (recurrent.py), else (and without them) kept whole. Raises :class:`DataflowError` if
    ``fn`` cannot be traced.
    """
    leaves = leaves_in_written_order(params)
    n = n_model_shards
    if n == 1:
        return [Placement(path, tuple(np.shape(x)), getattr(x, "dtype", np.float32), P(),
                          "replicated (one model shard)") for path, x in leaves]
    flat = leaves_with_paths(params)
    try:
        closed = jax.make_jaxpr(laid_out_for(fn, n, vendor_kernels=False))(abstract_tree(params), *abstract_tree(example_args))
    except Exception as e:  # noqa: BLE001 - any tracing failure means: use the structural rules
        raise DataflowError(f"could not trace the model: {type(e).__name__}: {e}") from e
    shapes = [tuple(np.shape(x)) for _, x in flat]
    if len(closed.jaxpr.invars) < len(flat):
        raise DataflowError("the traced function has fewer inputs than params has leaves")
    width = model_width([s for s in shapes])
    analysis = Analysis(closed, len(flat), shapes, n, width, RULES, link_costs)
    analysis.run()
    index = {path: i for i, (path, _) in enumerate(flat)}
    kv_groups = kv_head_groups(analysis) if group_kv_heads else {}
    out = []
    for path, x in leaves:
        i = index[path]
        axis, reason = analysis.placement(i)
        spec = P() if axis is None else P(*([None] * axis + [MODEL_AXIS]))
        if i in kv_groups:
            axis, groups = kv_groups[i]
            spec = P(*([None] * axis + [grouped(MODEL_AXIS, groups)]))
            reason = (f"K/V heads (axis {axis}, size {shapes[i][axis]}) over {groups} groups of "
                      f"{n // groups} shards: fewer heads than shards, each group keeps the heads "
                      "its query heads read")
        weight = len(shapes[i]) >= 2 and (i in analysis.used or axis is not None)
        out.append(Placement(path, shapes[i], getattr(x, "dtype", np.float32), spec, reason,
                             weight, routes=axis is None and analysis.routes(i)))
    return TracedPlacements(out, analysis.all_reduced_elements())


class TracedPlacements(list):
    """The placements :func:`dataflow_placements` gives (a list, one per leaf), with what
    Megatron's split of them moves: ``all_reduced_elements``, the elements of the values one
    forward pass of the traced function all-reduces over the model shards
    (Analysis.all_reduced_elements)."""

    def __init__(self, placements, all_reduced_elements):
        super().__init__(placements)
        self.all_reduced_elements = all_reduced_elements


FALLBACK = "shapes and order only"  # how traced_placements names the fallback plan's source


def traced_placements(fn, params, *example_args, n_model_shards, **plan_options):
    """``(placements, where they came from)`` by :func:`dataflow_placements` (``plan_options``:
    its keywords), or ``(None, why not)`` when the analysis cannot follow ``fn`` (the caller
    then keeps the shape rules)."""
    try:
        return (dataflow_placements(fn, params, *example_args, n_model_shards=n_model_shards,
                                    **plan_options), "the traced data flow")
    except Exception as e:  # noqa: BLE001 - any program the analysis cannot follow
        return None, f"{FALLBACK} (the data-flow analysis failed: {type(e).__name__}: {e})"
