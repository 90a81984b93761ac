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
a dot batch axis) and holds whole examples (a multiple of the global batch size) split evenly
over every device; or, where there are too few examples for that (SmolLM2 at seq 2048, 2
sequences a data shard of 2 x 4), split evenly over the data shards with its next axis (the
positions) free and split over the model shards (XLA pads an uneven last share: 511 positions, a
batch's ids shifted by one, as 4 x 128): the projections are position-wise, and XLA gathers K
and V for the scores of each model shard's queries (measured, SmolLM2's attention with 2 layers,
4 sequences of 1024, 2 x 4, fp32: 53.0 -> 13.8 GFLOP a device a step); and when nothing computed
from its output meets, in one operation, a value split over the model shards (a mixture of
experts' router, kept whole, whose gates are contracted with the outputs of experts split by
expert: pinned by batch, the routing is gathered to every expert's shard, 14x Megatron's bytes
measured). Reading its output into the matmul of a split weight (the MLP after the attention) is
not meeting a split: that matmul gathers its input, once. Positions are not split in a program
holding an operation JAX lowers with the devices in hand (device_bound.py): XLA spreads that split
along the residual stream into the next attention's inputs, and cuDNN's attention, a GPU's in
bfloat16, refuses them there (the compile fails: "Sharding on sequence dim is not allowed").

The qualifying matmuls are split only where that pays: the compute the model shards no longer
repeat (their FLOPs and those of the matmuls between them, the attention's scores and values;
forward and backward) against the bytes the split adds (the output of each one whose result
leaves the split, and of each one split by positions, which the attention mixes: gathered
forward and scattered backward), weighed at the platform's FLOPs per link byte
(layout/cost_model.py's rates). An MLP-Mixer's narrow token-mixing MLP does not pay (96 FLOPs
per byte, CPU's threshold 667), SmolLM2's attention does (2,300).
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
from .device_bound import device_bound
from .interpreter import (CALLS, REMATS, bind, called, evaluate, follow, opened, output_axes,
                          scan_operand_groups, sub_programs, total)
from .paths import leaves_with_paths


def _is_matmul(eqn):
    return eqn.primitive.name == "dot_general"


def _activation_split(eqn, ins, shards, batch_size):
    """``(side, spec)`` for ``eqn`` the matmul of a weight kept whole over the model shards:
    its activation operand (0 or 1) and the mesh axes to split that operand's leading axes over;
    or None. By whole examples over every device, ``((data, model),)``, where the leading axis
    holds them evenly; else by examples over the data shards and the next axis (positions)
    over the model shards, ``(data, model)``, where the examples divide and there is more than
    one position (unevenly too: XLA pads the last share, 511 positions as 4 x 128; what that
    costs, :func:`_kept`). ``ins``: the operands' origins; ``shards``: (data shards, model
    shards)."""
    if not _is_matmul(eqn):
        return None
    whole = [o is not None and not o.weight.axes for o in ins[:2]]
    if whole.count(True) != 1 or ins[1 - whole.index(True)] is not None:
        return None  # not one whole weight against one activation
    side = 1 - whole.index(True)
    shape = eqn.invars[side].aval.shape
    contracted, batched = (d[side] for d in eqn.params["dimension_numbers"])
    free = [d for d in range(len(shape)) if d not in contracted and d not in batched]
    (dp, mp), rows = shards, shape[0] if shape else 0
    if not rows or 0 not in free or rows % batch_size:
        return None
    if rows % (dp * mp) == 0:
        return side, ((DATA_AXIS, MODEL_AXIS),)
    if rows % dp == 0 and 1 in free and shape[1] > 1:
        return side, (DATA_AXIS, MODEL_AXIS)
    return None


def shards_of(mesh):
    """``(data shards, model shards)`` of ``mesh``: what a split is weighed against."""
    return mesh.shape.get(DATA_AXIS, 1), mesh.shape.get(MODEL_AXIS, 1)


def _kept(eqn, side, spec, model_shards):
    """The share of its data shard's work that a device keeps when ``eqn``'s activation
    (operand ``side``) is split as ``spec`` says: a model shard's, or where the positions do not
    divide, the padded share XLA gives each (128 of 511 over 4)."""
    if len(spec) == 1:
        return 1 / model_shards
    positions = eqn.invars[side].aval.shape[1]
    return -(-positions // model_shards) / positions


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
    bytes x trips, the share of them a device keeps split), those meeting a split, the
    qualifying matmuls each one's input came from, those whose output a split weight's matmul
    reads (gathered there), those split by positions (``by_position``), and the matmuls of two
    activations computed from qualifying ones only (``between``, by id: FLOPs x trips and the
    qualifying matmuls they came from: the attention's scores and values, repeated on every
    model shard as theirs are)."""
    matmuls: dict = dataclasses.field(default_factory=dict)
    met: set = dataclasses.field(default_factory=set)
    upstream: dict = dataclasses.field(default_factory=dict)
    gathered: set = dataclasses.field(default_factory=set)
    by_position: set = dataclasses.field(default_factory=set)
    between: dict = dataclasses.field(default_factory=dict)
    device_bound: bool = False  # whether it holds an operation lowered with the devices


NOTHING = (False, frozenset())  # a value's facts: (split over the model shards, whole matmuls)


def _walk(program, origins, facts_in, found, shards, batch_size, trips=1):
    """Fills ``found`` from ``program`` and the calls and scans it makes; returns its outputs'
    facts. A value's facts: whether it is split over the model shards, and the qualifying
    matmuls it is computed from; the matmul of a split weight reads its input (gathered) and
    starts afresh. ``origins``: {variable: Origin}; ``facts_in``: the inputs' facts;
    ``shards``: (data shards, model shards)."""
    def rule(eqn, facts):
        facts = [f or NOTHING for f in facts]
        ins = [weight_origins.of(origins, v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in CALLS or name in REMATS or name == "scan":
            body = eqn.params["jaxpr"] if name == "scan" else called(eqn)
            inner = weight_origins.scan_body(eqn, ins) if name == "scan" else ins
            times = trips * (eqn.params["length"] if name == "scan" else 1)
            outs = _walk(body, weight_origins.propagate(body, inner), facts, found, shards,
                         batch_size, times)
            if name == "scan":  # a loop carry keeps the placement it came in with: what a
                # split matmul adds to it is gathered back at every iteration (an LSTM's gates
                # into its state: 121 gathers a step, 8.7x the step time, measured)
                _, n_carry, _ = scan_operand_groups(eqn)
                found.gathered.update(*(f[1] for f in outs[:n_carry]))
            return outs
        is_split = any(f[0] for f in facts)
        came_from = frozenset().union(*(f[1] for f in facts))
        found.device_bound = found.device_bound or device_bound(eqn)
        if _is_matmul(eqn) and any(o is not None and o.weight.axes for o in ins[:2]):
            found.gathered.update(came_from)
            return [(_split_weight_output(eqn, ins), frozenset())]
        split = _activation_split(eqn, ins, shards, batch_size)
        if split is not None:
            out = eqn.outvars[0].aval
            found.matmuls[id(eqn)] = (matmul_flops(eqn) * trips,
                                      np.prod(out.shape) * out.dtype.itemsize * trips,
                                      _kept(eqn, *split, shards[1]))
            found.upstream[id(eqn)] = came_from
            if len(split[1]) > 1:
                found.by_position.add(id(eqn))
            if is_split:  # a qualifying matmul of a split input is left as it is
                found.met.add(id(eqn))
            came_from = frozenset([id(eqn)])
        elif is_split and came_from:
            found.met.update(came_from)
        elif _is_matmul(eqn) and came_from and all(o is None for o in ins[:2]):
            found.between[id(eqn)] = (matmul_flops(eqn) * trips, came_from)
        return [(is_split, came_from)] * len(eqn.outvars)

    env = follow(program, facts_in, rule)
    return [env.get(v, NOTHING) if isinstance(v, jcore.Var) else NOTHING
            for v in opened(program)[0].outvars]


def worth_splitting(found, mesh, flops_per_byte, training=True):
    """The ids of the matmuls to split: the qualifying ones that meet no split (nor feed one
    that does), if the compute they stop repeating (theirs and that of the matmuls between
    them; x3 in ``training``: forward and backward) outweighs, at ``flops_per_byte``, the bytes
    they add (each output a split weight's matmul reads, and each output of one split by
    positions, whose positions the attention mixes: all-gathered forward, and in training
    reduce-scattered backward); else none. Per device: the traced program is global."""
    met, todo = set(), list(found.met)
    while todo:  # what a met matmul's input came from would feed it split otherwise
        i = todo.pop()
        if i not in met:
            met.add(i)
            todo.extend(found.upstream.get(i, ()))
    chosen = set(found.matmuls) - met
    if found.device_bound:  # XLA spreads a split of positions beyond the matmuls split, along
        # the residual stream into the next attention's inputs; cuDNN's attention refuses it
        # there ("Sharding on sequence dim is not allowed", the GPU compile fails). A split of
        # whole examples, which cuDNN takes as any data-parallel run's batch, is still made.
        chosen -= found.by_position
    passes, transfers = (3, 2) if training else (1, 1)
    shed = {i: 1 - found.matmuls[i][2] for i in chosen}  # what a device no longer computes
    saved = (sum(found.matmuls[i][0] * shed[i] for i in chosen)
             + sum(f * min(shed[i] for i in came_from)
                   for f, came_from in found.between.values() if came_from <= chosen))
    moved = sum(transfers * found.matmuls[i][1] * shed[i]
                for i in chosen & (found.gathered | found.by_position))
    # per device: the traced program is global, its batch split over the data shards
    data_shards = shards_of(mesh)[0]
    saved, moved = saved * passes / data_shards, moved / data_shards
    return chosen if chosen and saved > moved * flops_per_byte else set()


def _split_over(x, splits, mesh):
    """``x`` constrained to be split as ``splits`` says ({axis: mesh axes}), whole along the
    rest."""
    spec = [None] * x.ndim
    for axis, mesh_axes in splits.items():
        spec[axis] = mesh_axes
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


def _matmuls(eqn, matmuls_in):
    return int(_is_matmul(eqn)) + sum(matmuls_in(sub) for _, _, sub in sub_programs(eqn))


def _has_matmul(program):
    """Whether ``program``, or a program it holds, has a matmul."""
    return total(program, _matmuls) > 0


def split_batches_of_whole_weights(fn, mesh, plan, batch_size, flops_per_byte, training=True):
    """``fn(params, ...)`` with the matmuls of weights ``plan`` (a RewritePlan of ``params``,
    rewrite_plan.py) keeps whole over the model shards run on a share of the batch (its
    examples, or its positions) per device, where that pays at ``flops_per_byte`` (see the module docstring); ``batch_size``: the
    global batch's leading size; ``training``: whether ``fn`` is differentiated (the backward
    pass saves and moves as much again). On a mesh without model shards, or with the plan unknown,
    ``fn`` itself."""
    shards = shards_of(mesh)
    if shards[1] == 1 or not plan.knows_placements:
        return fn

    def rule(chosen, entries, eqn, vals, ins):
        if id(eqn) not in chosen:
            return None
        side, spec = _activation_split(eqn, ins, shards, batch_size)
        vals = list(vals)
        if id(eqn) in entries:  # kept as it comes (split over the data shards only) up to here,
            # so that the split does not spread back into what computed it (a classifier head:
            # the whole network's activations, 2.5x Megatron's bytes per layer measured)
            vals[side] = _split_over(vals[side], {0: DATA_AXIS}, mesh)
        vals[side] = _split_over(vals[side], dict(enumerate(spec)), mesh)
        out = bind(eqn, vals)[0]
        axes = output_axes(eqn)
        return [_split_over(out, {axes[(side, d)]: m for d, m in enumerate(spec)}, mesh)]

    def split(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat = jax.tree_util.tree_leaves(args)
        origins = weight_origins.of_weights(plan.leaf_splits(leaves_with_paths(args[0])))
        origins += [None] * (len(flat) - len(origins))
        found = _Found()
        _walk(closed.jaxpr, weight_origins.propagate(closed.jaxpr, origins), [NOTHING] * len(flat),
              found, shards, batch_size)
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
