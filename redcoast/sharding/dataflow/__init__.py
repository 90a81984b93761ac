"""Tensor-parallel placement from the model's data flow (DESIGN.md §3).

``dataflow_placements(fn, params, *example_args, n_model_shards)`` traces ``fn(params, *args)``
with ``jax.make_jaxpr`` on abstract inputs (no FLOPs) and follows every value through the
program, recursing into jit, remat, custom_jvp/vjp, scan, while and cond. Each value is one of

* ``Rep``   replicated over the model shards (the residual stream, attention masks, constants),
* ``Split`` split over the model shards along one axis (the inside of a Megatron block),
* ``Par``   a parameter seen through layout ops only (transpose, reshape, cast, slice of a stack).

The paper's two rules then fall out of the matmuls: a parameter multiplied with a replicated
activation is column-parallel (its output axis is split: the heads of a 3-D kernel, the experts of
a stacked MoE kernel, the vocabulary of an LM head); a parameter multiplied with an activation split
on the contracting axis is row-parallel (that axis is split, the output is summed over the shards:
the all-reduce). Splits flow through elementwise ops (an einsum that contracts nothing is one:
rotary tables multiplied in by ``einsum``), reshapes that keep the split axis whole,
transposes, per-head einsums, and slices, concatenations, stacks, gathers and scatters along other
axes (GPT-J's rotary stacks the even and odd halves of head_dim; block-sparse attention gathers
key blocks per head by vmap or ``take_along_axis``, the heads a batching axis of the gather);
biases added to a split output follow it; a lookup into a parameter is an embedding (vocabulary
split when it divides, else hidden).

A scan that applies the same weights at every step is a recurrent cell: its replicated carries
are its state. Split by hidden units, the state would be all-gathered at every step: where the
compute saved pays for that at the platform's rates (recurrent.py) the gates split and the state
with them, gathered; else a gate whose split would meet or become the state keeps every weight of
that split whole. A replicated
value broadcast into a split (a [batch, 1, 1, C] scale or shift) is sliced where it is read.

A split that cannot go on without communication — sliced (a fused QKV written as one (hidden,
3*hidden) matrix), concatenated, reduced over the model width (a norm), added to the residual
stream, fed to a matmul whose parameter cannot be split — is a *conflict*: the parameters that
created it try their next candidate axis, or are replicated with the reason, and the trace is
walked again until no conflict is left. Nothing depends on names, dict order or kernel layout.

The package: ``values.py`` (what a value can be), ``analysis.py`` (the walks, conflicts and
decisions), the rules that follow each operation by what they know (``layout_ops.py``:
transposes, reshapes, slices, joins, reductions; ``gathers.py``: gathers and scatters, the
embedding; ``products.py``: matmuls and convolutions, the column/row rules; ``control.py``:
scan, while, cond; ``recurrent.py``: what a recurrent cell's split costs), and ``placements.py``
(the entry points).
"""

from .placements import (FALLBACK, RULES, TracedPlacements, abstract_tree, dataflow_placements,
                         traced_placements)
from .recurrent import LinkCosts
from .values import DataflowError, reshape_groups

__all__ = ["FALLBACK", "RULES", "DataflowError", "LinkCosts", "TracedPlacements", "abstract_tree",
           "dataflow_placements", "reshape_groups", "traced_placements"]
