"""Matmuls of weights kept whole over the model shards, run on a share of the batch each.

Where the plan cannot split a weight over the model shards (SmolLM2's 9 attention heads over 2
or 4 shards, its 3 K/V heads, any weight the data-flow analysis had to keep whole), every model
shard holds it whole and, left to XLA, computes its matmul on the whole of its data shard's
batch: the same work repeated size('mp') times. This rewrite splits such a matmul's activation
by its leading axis (the batch's examples, or rows made from them) over the data and model
shards together, and its output alike, so that each model shard computes its own share; what
lies between two such matmuls (the attention's scores, softmax and values) follows, and XLA
moves the activations between that split and the model-split layers around it (an all-gather of
the block's output per layer forward, a reduce-scatter backward). Measured on SmolLM2-135M (30
layers, seq 128, batch 8, 2 x 4, bf16, CPU): the step 15.8 s -> 7.5 s, the compiled peak 1018
-> 721 MiB.

A matmul qualifies when its weight operand is a parameter (weight_origins.py) that the plan
splits over no model shard, and its other operand's leading axis is free (neither contracted nor
a dot batch axis) and holds whole examples split evenly over every device (a multiple of the
global batch size, divisible by the device count); and when nothing computed from its output
meets, in one operation, a value split over the model shards (a mixture of experts' router,
kept whole, whose gates are contracted with the outputs of experts split by expert: pinned by
batch, the routing is gathered to every expert's shard, 14x Megatron's bytes measured). Reading
its output into the matmul of a split weight (the MLP after the attention) is not meeting a
split: that matmul gathers its input, once.

The qualifying matmuls are split only where that pays: the compute the model shards no longer
repeat (their FLOPs, forward and backward) against the bytes the split adds (the output of each
one whose result leaves the split, gathered forward and scattered backward), weighed at the
platform's FLOPs per link byte (layout/cost_model.py's rates). An MLP-Mixer's narrow token-mixing
MLP does not pay (96 FLOPs per byte, CPU's threshold 667), SmolLM2's attention does (2,300).
"""

import dataclasses
import functools

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec as P

from . import weight_origins
from .axes import DATA_AXIS, MODEL_AXIS
from .dataflow.recurrent import matmul_flops
from .interpreter import (CALLS, REMATS, bind, called, evaluate, follow, opened, output_axes,
                          scan_operand_groups, sub_programs, total)
from .paths import leaves_with_paths


def _is_matmul(eqn):
    return eqn.primitive.name == "dot_general"


def _activation_side(eqn, ins, devices, batch_size):
    """The operand (0 or 1) of ``eqn`` that is the activation of a matmul of a weight kept whole
    over the model shards, its leading axis whole examples split evenly over ``devices``; or
    None. ``ins``: the operands' origins."""
    if not _is_matmul(eqn):
        return None
    whole = [o is not None and not o.weight.axes for o in ins[:2]]
    if whole.count(True) != 1 or ins[1 - whole.index(True)] is not None:
        return None  # not one whole weight against one activation
    side = 1 - whole.index(True)
    shape = eqn.invars[side].aval.shape
    contracted, batched = (d[side] for d in eqn.params["dimension_numbers"])
    rows = shape[0] if shape else 0
    if not rows or 0 in contracted or 0 in batched or rows % devices or rows % batch_size:
        return None
    return side


def _split_weight_output(eqn, ins):
    """Whether ``eqn`` is the matmul of a weight split over the model shards along an axis it
    does not contract (a column-parallel or an expert-split output: split itself)."""
    for side, o in enumerate(ins[:2]):
        if o is not None and o.weight.axes:
            contracted = eqn.params["dimension_numbers"][0][side]
            return o.split_along([d for d in range(len(o.axes)) if d not in contracted])
    return False


@dataclasses.dataclass
class _Found:
    """What the walk found: the qualifying matmuls (by id: their FLOPs x trips, their output's
    bytes x trips), those meeting a split, the qualifying matmuls each one's input came from,
    and those whose output a split weight's matmul reads (gathered there)."""
    matmuls: dict = dataclasses.field(default_factory=dict)
    met: set = dataclasses.field(default_factory=set)
    upstream: dict = dataclasses.field(default_factory=dict)
    gathered: set = dataclasses.field(default_factory=set)


NOTHING = (False, frozenset())  # a value's facts: (split over the model shards, whole matmuls)


def _walk(program, origins, facts_in, found, devices, batch_size, trips=1):
    """Fills ``found`` from ``program`` and the calls and scans it makes; returns its outputs'
    facts. A value's facts: whether it is split over the model shards, and the qualifying
    matmuls it is computed from; the matmul of a split weight reads its input (gathered) and
    starts afresh. ``origins``: {variable: Origin}; ``facts_in``: the inputs' facts."""
    def rule(eqn, facts):
        facts = [f or NOTHING for f in facts]
        ins = [weight_origins.of(origins, v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in CALLS or name in REMATS or name == "scan":
            body = eqn.params["jaxpr"] if name == "scan" else called(eqn)
            inner = weight_origins.scan_body(eqn, ins) if name == "scan" else ins
            times = trips * (eqn.params["length"] if name == "scan" else 1)
            outs = _walk(body, weight_origins.propagate(body, inner), facts, found, devices,
                         batch_size, times)
            if name == "scan":  # a loop carry keeps the placement it came in with: what a
                # split matmul adds to it is gathered back at every iteration (an LSTM's gates
                # into its state: 121 gathers a step, 8.7x the step time, measured)
                _, n_carry, _ = scan_operand_groups(eqn)
                found.gathered.update(*(f[1] for f in outs[:n_carry]))
            return outs
        is_split = any(f[0] for f in facts)
        came_from = frozenset().union(*(f[1] for f in facts))
        if _is_matmul(eqn) and any(o is not None and o.weight.axes for o in ins[:2]):
            found.gathered.update(came_from)
            return [(_split_weight_output(eqn, ins), frozenset())]
        if _activation_side(eqn, ins, devices, batch_size) is not None:
            out = eqn.outvars[0].aval
            found.matmuls[id(eqn)] = (matmul_flops(eqn) * trips,
                                      np.prod(out.shape) * out.dtype.itemsize * trips)
            found.upstream[id(eqn)] = came_from
            if is_split:  # a qualifying matmul of a split input is left as it is
                found.met.add(id(eqn))
            came_from = frozenset([id(eqn)])
        elif is_split and came_from:
            found.met.update(came_from)
        return [(is_split, came_from)] * len(eqn.outvars)

    env = follow(program, facts_in, rule)
    return [env.get(v, NOTHING) if isinstance(v, jcore.Var) else NOTHING
            for v in opened(program)[0].outvars]


def worth_splitting(found, mesh, flops_per_byte, training=True):
    """The ids of the matmuls to split: the qualifying ones that meet no split (nor feed one
    that does), if the compute they stop repeating (x3 in ``training``: forward and backward)
    outweighs, at ``flops_per_byte``, the bytes they add (each output a split weight's matmul
    reads: all-gathered forward, and in training reduce-scattered backward); else none. Per
    device: the traced program is global."""
    met, todo = set(), list(found.met)
    while todo:  # what a met matmul's input came from would feed it split otherwise
        i = todo.pop()
        if i not in met:
            met.add(i)
            todo.extend(found.upstream.get(i, ()))
    chosen = set(found.matmuls) - met
    dp, mp = mesh.shape.get(DATA_AXIS, 1), mesh.shape.get(MODEL_AXIS, 1)
    share = (1 - 1 / mp) / dp
    passes, transfers = (3, 2) if training else (1, 1)
    saved = sum(passes * found.matmuls[i][0] for i in chosen) * share
    moved = sum(transfers * found.matmuls[i][1] for i in chosen & found.gathered) * share
    return chosen if chosen and saved > moved * flops_per_byte else set()


def _split_over(x, axis, mesh_axes, mesh):
    """``x`` constrained to be split along ``axis`` over ``mesh_axes``, whole along the rest."""
    spec = [None] * x.ndim
    spec[axis] = mesh_axes
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


def _matmuls(eqn, matmuls_in):
    return int(_is_matmul(eqn)) + sum(matmuls_in(sub) for _, _, sub in sub_programs(eqn))


def _has_matmul(program):
    """Whether ``program``, or a program it holds, has a matmul."""
    return total(program, _matmuls) > 0


def split_batches_of_whole_weights(fn, mesh, plan, batch_size, flops_per_byte, training=True):
    """``fn(params, ...)`` with the matmuls of weights ``plan`` (a RewritePlan of ``params``,
    rewrite_plan.py) keeps whole over the model shards run on a share of the batch per device,
    where that pays at ``flops_per_byte`` (see the module docstring); ``batch_size``: the
    global batch's leading size; ``training``: whether ``fn`` is differentiated (the backward
    pass saves and moves as much again). On a mesh without model shards, or with the plan unknown,
    ``fn`` itself."""
    if mesh.shape.get(MODEL_AXIS, 1) == 1 or not plan.knows_placements:
        return fn

    def rule(chosen, entries, eqn, vals, ins):
        if id(eqn) not in chosen:
            return None
        side = _activation_side(eqn, ins, mesh.size, batch_size)
        vals = list(vals)
        if id(eqn) in entries:  # kept as it comes (split over the data shards only) up to here,
            # so that the split does not spread back into what computed it (a classifier head:
            # the whole network's activations, 2.5x Megatron's bytes per layer measured)
            vals[side] = _split_over(vals[side], 0, DATA_AXIS, mesh)
        vals[side] = _split_over(vals[side], 0, (DATA_AXIS, MODEL_AXIS), mesh)
        out = bind(eqn, vals)[0]
        return [_split_over(out, output_axes(eqn)[(side, 0)], (DATA_AXIS, MODEL_AXIS), mesh)]

    def split(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat = jax.tree_util.tree_leaves(args)
        origins = weight_origins.of_weights(plan.leaf_splits(leaves_with_paths(args[0])))
        origins += [None] * (len(flat) - len(origins))
        found = _Found()
        _walk(closed.jaxpr, weight_origins.propagate(closed.jaxpr, origins), [NOTHING] * len(flat),
              found, mesh.size, batch_size)
        chosen = worth_splitting(found, mesh, flops_per_byte, training)
        if not chosen:  # the program as traced (tracing ``fn`` again would cost as much again)
            outs = evaluate(closed.jaxpr, flat, consts=closed.consts)
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
        entries = {i for i in chosen if not found.upstream[i] & chosen}
        outs = weight_origins.run_with_origins(
            closed.jaxpr, closed.consts, flat, origins, functools.partial(rule, chosen, entries),
            _has_matmul)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
    return split
