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
are its state, and a gate whose split would meet or become the state keeps every weight of that
split whole (split by hidden units, the state would be all-gathered at every step). A replicated
value broadcast into a split (a [batch, 1, 1, C] scale or shift) is sliced where it is read.

A split that cannot go on without communication — sliced (a fused QKV written as one (hidden,
3*hidden) matrix), concatenated, reduced over the model width (a norm), added to the residual
stream, fed to a matmul whose parameter cannot be split — is a *conflict*: the parameters that
created it try their next candidate axis, or are replicated with the reason, and the trace is
walked again until no conflict is left. Nothing depends on names, dict order or kernel layout.
"""

import dataclasses
import math

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from . import kv_repeat
from .auto import model_width
from .axes import MODEL_AXIS
from .context import laid_out_for
from .grouped_axes import grouped
from .jaxpr_tools import output_axes, scan_operand_groups
from .paths import leaves_in_written_order, leaves_with_paths
from .rules import Placement
from .split_ends import KEPT, REDUCED, SplitEnds

MAX_ROUNDS = 100
_MET_REPLICATED = "its split output is added to a replicated activation"
_DEBUG = bool(__import__("os").environ.get("REDCOAST_DATAFLOW_DEBUG"))


class DataflowError(Exception):
    """The function could not be traced or analysed; callers fall back to structural rules."""


@dataclasses.dataclass(frozen=True)
class Rep:
    """Replicated over model shards. ``vary``: axes along which it depends on the data (a
    residual-stream-like value varies along its width; a one-hot along the vocabulary does not).
    ``src``: (leaf, {axis: parameter axis}) when it is the output of a matmul with a replicated
    parameter that could follow a split instead (a LoRA B matrix)."""
    vary: frozenset = frozenset()
    src: tuple = None
    tainted: bool = False  # computed from the fallback of a conflict: decisions on it are tentative
    state: tuple = None    # (shape, steps) of the recurrent state (a loop carry) it comes from


@dataclasses.dataclass(frozen=True)
class Split:
    """Split over model shards along ``axis``; ``origins``: the parameters whose choice made it."""
    axis: int
    origins: frozenset
    state: tuple = None    # as Rep's: computed from a recurrent state


@dataclasses.dataclass(frozen=True)
class Par:
    """A parameter leaf seen through layout ops; ``axes[i]`` is the parameter axis of axis i."""
    leaf: int
    axes: tuple


CONST = Rep()


def _all(ndim):
    return frozenset(range(ndim))


def _shape(v):
    return tuple(getattr(v.aval, "shape", ()))


def _reshape_groups(a, b):
    """Pairs (in axes, out axes) of equal element count, in order; size-1 axes join a group."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj, pi, pj = [], [], 1, 1
        while True:
            if pi == pj and (gi or gj):
                # the group is complete: size-1 axes next on either side join it, not the next
                # one ((8, 1, 1, 32) -> (8, 1, 1, 4, 2, 4): the 1s go with the 8, not the 32)
                while i < len(a) and a[i] == 1:
                    gi.append(i)
                    i += 1
                while j < len(b) and b[j] == 1:
                    gj.append(j)
                    j += 1
                break
            if pi <= pj and i < len(a):
                pi *= a[i]
                gi.append(i)
                i += 1
            elif j < len(b):
                pj *= b[j]
                gj.append(j)
                j += 1
            elif i < len(a):
                pi *= a[i]
                gi.append(i)
                i += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def _major(axes, shape):
    """The first axis of a group with size > 1 (the one whose split keeps blocks contiguous)."""
    for x in axes:
        if shape[x] > 1:
            return x
    return None


def _gather_maps(dn, op_nd, idx_nd, out_nd):
    """Where a gather's axes go (XLA's semantics; JAX puts the index vector last): ``window``
    {operand axis: output axis} for the axes sliced, not collapsed; ``index`` {indices axis:
    output axis} for the indices' batch axes, which fill the non-window output axes in order;
    ``index_of`` {operand batching axis: its paired indices axis}; ``batching`` {operand
    batching axis: output axis}, element i of the operand axis landing at output i."""
    skipped = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
    window = dict(zip([a for a in range(op_nd) if a not in skipped], dn.offset_dims))
    index = dict(zip(range(idx_nd - 1), [o for o in range(out_nd) if o not in dn.offset_dims]))
    index_of = dict(zip(dn.operand_batching_dims, dn.start_indices_batching_dims))
    return {"window": window, "index": index, "index_of": index_of,
            "batching": {a: index[i] for a, i in index_of.items()}}


def _scatter_maps(dn, op_shape, upd_shape):
    """The operand axes a split may pass through a scatter on, with their copies in the other
    inputs: ``index_of`` {operand batching axis: its paired indices axis}; ``updates_of``
    {operand axis: updates axis} for the batching axes (the indices' batch axes fill the
    non-window updates axes in order) and the window axes the updates cover whole (window axes
    are the operand's axes neither inserted nor batching, in order)."""
    skipped = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
    window = zip([a for a in range(len(op_shape)) if a not in skipped], dn.update_window_dims)
    scatter_axes = [u for u in range(len(upd_shape)) if u not in dn.update_window_dims]
    index_of = dict(zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims))
    updates_of = {a: scatter_axes[i] for a, i in index_of.items()}
    updates_of.update({a: u for a, u in window if upd_shape[u] == op_shape[a]})
    return {"index_of": index_of, "updates_of": updates_of}


class _Analysis:
    def __init__(self, closed, n_params, leaf_shapes, n, width):
        self.closed = closed
        self.n_params = n_params
        self.shapes = leaf_shapes
        self.n = n
        self.width = width
        self.choice = {}       # leaf -> index of the candidate axis to try
        self.final = {}        # leaf -> reason it is replicated (candidates exhausted)
        self.wish = {}         # leaf -> parameter axis another split asks it to follow
        self.candidates = {}   # leaf -> [parameter axes] tried as column splits
        self.undivisible = {}  # leaf -> reason no candidate divided

    # ---- walks over the program until nothing conflicts -----------------------------------
    def run(self):
        """Walk until no split conflicts; then once more with the weights given up for meeting
        a replicated value reopened. A blame is made on what was decided before it in the same
        walk; a split decided earlier and given up later (a U-Net's stem, whose output is
        concatenated with the decoder's) may have made the replicated value it met (the row-
        parallel output of a convolution that reads the stem's split). Reopened, such a weight
        splits once that cause is gone; the second plan is kept if it replicates fewer bytes."""
        self._converge()
        reopen = [leaf for leaf, why in self.final.items() if why.startswith(_MET_REPLICATED)]
        if not reopen:
            return
        before = (dict(self.choice), dict(self.final), dict(self.wish))
        for leaf in reopen:
            del self.final[leaf]
            self.choice.pop(leaf, None)
        self._converge()
        if self._bytes(self.final) >= self._bytes(before[1]):
            self.choice, self.final, self.wish = before
            self._converge()

    def _converge(self):
        for _ in range(MAX_ROUNDS):
            self.decided = {}   # leaf -> (axis, kind, detail)
            self.blamed = {}    # leaf -> reason
            self.new_wishes = {}
            self.used = set()
            self.split_ends = SplitEnds()  # how each split ended: used split, or reduced away
            self.follow_conflicts = {}
            self.tentative = set()
            self.tainted_now = self.taint_out = self.clean_out = False
            self.jaxprs = {}       # id -> every (sub)program walked, for the K/V group pass
            self.weight_of = {}    # matmul eqn -> {(leaf, parameter axis of each operand axis)}
            ins = [Par(i, tuple(range(len(self.shapes[i])))) for i in range(self.n_params)]
            ins += [Rep(_all(len(_shape(v)))) for v in self.closed.jaxpr.invars[self.n_params:]]
            outs = self.eval_closed(self.closed, ins)
            returned = [s.origins for s in outs if isinstance(s, Split)]
            self.split_ends.note(frozenset().union(*returned), KEPT)  # outputs are used split
            for leaf, reason in self.split_ends.blames(self.is_split).items():
                self.blamed.setdefault(leaf, reason)
            if not self.blamed and not self.new_wishes:
                return
            # blames downstream of another conflict's fallback are not trusted this round
            blamed = {k: v for k, v in self.blamed.items() if k not in self.tentative} or self.blamed
            if _DEBUG:
                print("round: blamed", blamed, "wishes", self.new_wishes)
            for leaf, reason in blamed.items():
                self.choice[leaf] = self.choice.get(leaf, 0) + 1
                if self.choice[leaf] >= len(self.candidates.get(leaf, ())):
                    self.final[leaf] = reason
            self.wish.update(self.new_wishes)
        raise DataflowError(f"no stable placement after {MAX_ROUNDS} rounds")

    def conflict(self, origins, reason, taint=True):
        """The split made by ``origins`` cannot go on. With ``taint``, the replicated value used
        from here on is a stand-in (after the fix it may be split), so what is decided from it
        is tentative; without, it is replicated in any placement (the residual stream)."""
        for leaf in self._upstream(origins):
            self.blamed.setdefault(leaf, reason)
        if taint:
            self.taint_out = True
        else:
            self.clean_out = True

    def _upstream(self, origins):
        """The parameter among ``origins`` whose split was decided first this round. A split
        that later ones were decided from (a column split flowing into the next matmul, which
        then became row-parallel, so that the one after it read a replicated value and split
        its output) is the cause; the later ones may be right once it moves (measured: OPT with
        its embedding projected, where blaming all replicated every layer)."""
        order = {leaf: i for i, leaf in enumerate(self.decided)}
        known = [leaf for leaf in origins if leaf in order]
        if len(known) < 2 or len(known) < len(origins):
            return origins
        return [min(known, key=order.__getitem__)]

    def conflict_among(self, splits, reason, taint=True):
        """A conflict between several splits: if some are already given up this round, that
        explains it; otherwise all of them try again."""
        given_up = [s for s in splits if s.origins & set(self.blamed)]
        for s in given_up or splits:
            self.conflict(s.origins, reason, taint)

    def _tainted(self, s):
        if isinstance(s, Rep):
            return s.tainted
        if isinstance(s, Split):
            # a split already in conflict this round (a LayerNorm's mean reduced it away, but the
            # centred input goes on split) is about to change: what is decided from it is too
            return bool(s.origins & self.tentative) or bool(s.origins & self.blamed.keys())
        return False

    def decide(self, leaf, axis, kind, detail=""):
        """Record a split of ``leaf`` on ``axis``; False if it contradicts an earlier one."""
        if leaf in self.final:
            return False
        if leaf in self.decided:
            if self.decided[leaf][0] == axis:
                return True
            if kind == "follow":
                self.follow_conflicts[leaf] = "asked to follow two different splits"
                return False
            self.blamed.setdefault(leaf, f"used with two different splits (axes {self.decided[leaf][0]} and {axis})")
            self.candidates.setdefault(leaf, [])
            return False
        self.decided[leaf] = (axis, kind, detail)
        if self.tainted_now:
            self.tentative.add(leaf)
        return True

    def is_split(self, leaf):
        return leaf in self.decided and leaf not in self.final

    # ---- evaluation ------------------------------------------------------------------------
    def eval_closed(self, closed, ins):
        jaxpr = closed.jaxpr if hasattr(closed, "jaxpr") else closed
        self.jaxprs[id(jaxpr)] = jaxpr
        env = {}
        for v in jaxpr.constvars:
            env[v] = CONST
        for v, s in zip(jaxpr.invars, ins):
            env[v] = s

        def read(v):
            if isinstance(v, jcore.Literal):
                return CONST
            return env.get(v, CONST)

        for eqn in jaxpr.eqns:
            states = [read(v) for v in eqn.invars]
            try:
                outs = self.eval_eqn(eqn, states)
            except DataflowError:
                raise
            except Exception as e:  # noqa: BLE001 - named, then the caller keeps the shape rules
                raise DataflowError(f"the analysis could not follow the operation "
                                    f"'{eqn.primitive.name}' ({type(e).__name__}: {e})") from e
            for v, s in zip(eqn.outvars, outs):
                env[v] = s
        return [read(v) for v in jaxpr.outvars]

    def eval_eqn(self, eqn, ins):
        name = eqn.primitive.name
        if name in ("scan", "while", "cond"):
            return getattr(self, "op_" + name)(eqn, ins)
        handler = getattr(self, "op_" + name.replace("-", "_"), None)
        if handler is not None:
            return self._run_handler(handler, eqn, ins)
        sub = None
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
            if key in eqn.params and eqn.params[key] is not None:
                sub = eqn.params[key]
                break
        if sub is not None and not callable(sub):
            inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
            if len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
                return self.eval_closed(sub, ins)
        handler = self.elementwise_op if len(eqn.outvars) == 1 and self._elementwise(eqn) else self.unknown_op
        return self._run_handler(handler, eqn, ins)

    def _run_handler(self, handler, eqn, ins):
        """Run one op's handler; replicated outputs of tainted inputs stay tainted."""
        self.tainted_now = any(self._tainted(s) for s in ins)
        self.taint_out = self.clean_out = False
        outs = handler(eqn, ins)
        if (self.tainted_now or self.taint_out) and not self.clean_out:
            outs = [dataclasses.replace(o, tainted=True) if isinstance(o, Rep) else o for o in outs]
        state = next((s.state for s in ins if isinstance(s, (Rep, Split)) and s.state), None)
        if state:  # computed from a recurrent state (an LSTM's gates from h): still the state's
            outs = [dataclasses.replace(o, state=state)
                    if isinstance(o, (Rep, Split)) and not o.state else o for o in outs]
        return outs

    def elementwise_op(self, eqn, ins):
        return [self.elementwise(eqn, ins)]

    def unknown_op(self, eqn, ins):
        return self.unknown(eqn, ins, f"'{eqn.primitive.name}'")

    @staticmethod
    def _elementwise(eqn):
        out = _shape(eqn.outvars[0])
        return all(_shape(v) == () or (len(_shape(v)) == len(out) and all(
            a in (b, 1) for a, b in zip(_shape(v), out))) for v in eqn.invars)

    def unknown(self, eqn, ins, what):
        """An op redcoast does not model: a split entering it is a conflict; outputs replicated."""
        for s in ins:
            if isinstance(s, Split):
                self.conflict(s.origins, f"its split output reaches {what}, which would need communication")
        data = any(isinstance(s, (Split,)) or (isinstance(s, Rep) and s.vary) for s in ins)
        return [Rep(_all(len(_shape(v))) if data else frozenset()) for v in eqn.outvars]

    def elementwise(self, eqn, ins):
        out = _shape(eqn.outvars[0])
        nd = len(out)
        full = []
        split = any(isinstance(s, Split) for s in ins)
        for v, s in zip(eqn.invars, ins):
            shp = _shape(v)
            if len(shp) != nd and nd:
                continue  # a scalar
            bcast = {i for i in range(nd) if shp[i] != out[i]}  # size-1 axes broadcast here
            if bcast and isinstance(s, Rep) and split:
                # broadcast into a split (a time embedding's [b, 1, 1, C] scale or shift, an
                # adaLN modulation): each shard reads its slice, nothing moves; unlike the
                # residual stream, which is never broadcast
                s = Rep(frozenset(), None, s.tainted, s.state)
            elif bcast and isinstance(s, Rep):
                s = Rep(s.vary - bcast, None if s.src else None)
            elif bcast and isinstance(s, Par):
                s = Par(s.leaf, tuple(None if i in bcast else a for i, a in enumerate(s.axes)))
            full.append(s)
        return self.combine(full, nd)

    def combine(self, full, nd):
        """The output of operands laid over its ``nd`` axes (broadcast axes already dropped
        from their ``vary`` and ``axes``), combined element by element."""
        splits = [s for s in full if isinstance(s, Split)]
        pars = [s for s in full if isinstance(s, Par)]
        reps = [s for s in full if isinstance(s, Rep)]
        if not splits:
            if pars and all(not r.vary for r in reps):
                return pars[0] if len(pars) == 1 else CONST
            vary = frozenset().union(*(r.vary for r in reps)) if reps else frozenset()
            srcs = [r.src for r in reps if r.src is not None]
            data = [r for r in reps if r.vary]
            src = srcs[0] if len(srcs) == 1 and len(data) == 1 else None
            return Rep(vary, src, state=next((r.state for r in reps if r.state), None))
        axes = {s.axis for s in splits}
        origins = frozenset().union(*(s.origins for s in splits))
        if len(axes) > 1:
            self.conflict_among(splits, "two operands split on different axes meet")
            return Rep(_all(nd))
        a = axes.pop()
        state = next((x.state for x in splits + reps if x.state), None)
        for r in reps:
            if a in r.vary:
                if state:  # in a recurrent cell: a gate meets the state (a GRU's r * h)
                    self.recurrent_state(origins, *state)
                    return Rep(_all(nd))
                if not self.residual_meet(r, a, origins):
                    self.conflict(origins, _MET_REPLICATED + " (the residual stream), which "
                                           "would need an all-gather", taint=False)
                    return Rep(_all(nd))
        for p in pars:
            pa = p.axes[a]
            if pa is not None:
                self.decide(p.leaf, pa, "follow", "added to a split output")
        return Split(a, origins)

    def _bytes(self, leaves):
        return sum(int(np.prod(self.shapes[i])) for i in leaves)

    def residual_meet(self, rep, axis, origins):
        """A split meets a replicated matmul output: ask that matmul's parameter to follow the
        split instead, when that replicates fewer parameter bytes than giving up the split
        (a LoRA B next to its base: yes; the residual stream: there is no such parameter)."""
        if rep.src is None or self.tainted_now:
            return False
        leaf, axmap, upstream = rep.src
        pa = axmap.get(axis)
        if pa is None or leaf in self.final or self.shapes[leaf][pa] % self.n:
            return False
        if leaf in origins or self._bytes(upstream) >= self._bytes(origins):
            return False
        if leaf in self.wish:  # asked before: still under way unless it asked for another axis
            return self.wish[leaf] == pa
        self.new_wishes[leaf] = pa
        return True

    # ---- layout ops --------------------------------------------------------------------------
    def op_transpose(self, eqn, ins):
        (s,) = ins
        perm = eqn.params["permutation"]
        if isinstance(s, Split):
            return [Split(list(perm).index(s.axis), s.origins)]
        if isinstance(s, Par):
            return [Par(s.leaf, tuple(s.axes[p] for p in perm))]
        src = None
        if s.src is not None:
            src = (s.src[0], {list(perm).index(k): v for k, v in s.src[1].items()}, s.src[2])
        return [Rep(frozenset(list(perm).index(a) for a in s.vary), src)]

    def op_reshape(self, eqn, ins):
        (s,) = ins[:1]
        a_shape, b_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
        groups = _reshape_groups(a_shape, b_shape)
        if isinstance(s, Split):
            for gi, gj in groups:
                if s.axis in gi:
                    if _major(gi, a_shape) == s.axis:
                        o = _major(gj, b_shape)
                        if o is not None and b_shape[o] % self.n == 0:
                            return [Split(o, s.origins)]
                    self.conflict(s.origins, f"a reshape {a_shape} -> {b_shape} breaks its split axis "
                                             "(e.g. a fused Q/K/V written as one matrix)")
                    return [Rep(_all(len(b_shape)))]
        if isinstance(s, Par):
            axes = [None] * len(b_shape)
            for gi, gj in groups:
                i, j = _major(gi, a_shape), _major(gj, b_shape)
                if i is None or j is None:
                    continue
                merged = [x for x in gi if a_shape[x] > 1]
                # axes merged into one: a split of the result in n blocks is a split of the
                # parameter axis of the major one only if that one divides (a K weight repeated
                # by hand, (kv, group, head_dim) merged: n > kv would cut head_dim)
                if any(s.axes[x] != s.axes[i] for x in merged) and a_shape[i] % self.n:
                    continue
                axes[j] = s.axes[i]
            return [Par(s.leaf, tuple(axes))]
        vary = set()
        for gi, gj in groups:
            if any(x in s.vary for x in gi):
                vary |= {j for j in gj if b_shape[j] > 1}
        return [Rep(frozenset(vary))]

    def op_squeeze(self, eqn, ins):
        (s,) = ins
        dims = set(d % len(_shape(eqn.invars[0])) for d in eqn.params["dimensions"])
        keep = [i for i in range(len(_shape(eqn.invars[0]))) if i not in dims]
        if isinstance(s, Split):
            return [Split(keep.index(s.axis), s.origins)]
        if isinstance(s, Par):
            return [Par(s.leaf, tuple(s.axes[i] for i in keep))]
        return [Rep(frozenset(keep.index(a) for a in s.vary if a in keep))]

    def op_expand_dims(self, eqn, ins):
        return self.op_reshape(eqn, ins)

    def op_broadcast_in_dim(self, eqn, ins):
        s = ins[0]
        a_shape, b_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
        bd = eqn.params["broadcast_dimensions"]
        same = [a_shape[i] == b_shape[bd[i]] for i in range(len(a_shape))]
        if isinstance(s, Split):
            return [Split(bd[s.axis], s.origins)]
        if isinstance(s, Par):
            axes = [None] * len(b_shape)
            for i, d in enumerate(bd):
                if same[i]:
                    axes[d] = s.axes[i]
            return [Par(s.leaf, tuple(axes))]
        return [Rep(frozenset(bd[i] for i in s.vary if same[i] and b_shape[bd[i]] > 1))]

    def _slice_like(self, eqn, s, full):
        """A slice that keeps axes where ``full[i]``; a split on a cut axis is a conflict."""
        nd = len(full)
        if isinstance(s, Split):
            if full[s.axis]:
                return Split(s.axis, s.origins)
            self.conflict(s.origins, f"its split output is sliced along the split axis "
                                     f"({eqn.primitive.name}), e.g. Q, K, V cut out of one fused output")
            return Rep(_all(nd))
        if isinstance(s, Par):
            return Par(s.leaf, tuple(p if full[i] else None for i, p in enumerate(s.axes)))
        return Rep(s.vary)

    def op_slice(self, eqn, ins):
        shp = _shape(eqn.invars[0])
        lo, hi, st = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.params["strides"]
        full = [lo[i] == 0 and hi[i] == shp[i] and (st is None or st[i] == 1) for i in range(len(shp))]
        return [self._slice_like(eqn, ins[0], full)]

    def op_dynamic_slice(self, eqn, ins):
        shp = _shape(eqn.invars[0])
        sizes = eqn.params["slice_sizes"]
        return [self._slice_like(eqn, ins[0], [sizes[i] == shp[i] for i in range(len(shp))])]

    def op_split(self, eqn, ins):
        shp = _shape(eqn.invars[0])
        axis = eqn.params["axis"] % len(shp)
        # one piece is the whole operand (``(q,) = jnp.split(x, 1, axis)``): an identity
        full = [i != axis or len(eqn.outvars) == 1 for i in range(len(shp))]
        return [self._slice_like(eqn, ins[0], full) for _ in eqn.outvars]

    def op_rev(self, eqn, ins):
        dims = eqn.params["dimensions"]
        return [self._slice_like(eqn, ins[0], [i not in dims for i in range(len(_shape(eqn.invars[0])))])]

    def op_pad(self, eqn, ins):
        cfg = eqn.params["padding_config"]
        s = self._slice_like(eqn, ins[0], [tuple(c) == (0, 0, 0) for c in cfg])
        if isinstance(s, Par):
            s = CONST
        return [s]

    def _joined(self, ins, along, nd, what):
        """Operands joined along their axis ``along``: a split passes through when every operand
        is split the same way on another axis (each shard joins its own pieces); else None."""
        splits = [s for s in ins if isinstance(s, Split)]
        if not splits:
            return None
        origins = frozenset().union(*(s.origins for s in splits))
        axes = {s.axis for s in splits}
        if len(axes) > 1 or along in axes or len(splits) != len(ins):
            self.conflict(origins, f"its split output is {what} with others along its split axis "
                                   "or with values split another way")
            return Rep(_all(nd))
        return Split(axes.pop(), origins)

    def op_concatenate(self, eqn, ins):
        d = eqn.params["dimension"]
        nd = len(_shape(eqn.outvars[0]))
        joined = self._joined(ins, d, nd, "concatenated")
        if joined is not None:
            return [joined]
        # a concatenation of parameters is used as a replicated constant
        vary = frozenset().union(*(s.vary for s in ins if isinstance(s, Rep)))
        return [Rep(vary | ({d} if vary else frozenset()))]

    def op_stack(self, eqn, ins):
        """``jnp.stack`` (jax's 'stack' primitive): the operands join along a new axis, so the
        output's axes from ``axis`` on are one further than the operands'."""
        d = eqn.params["axis"]
        nd = len(_shape(eqn.outvars[0]))
        shift = lambda a: a + 1 if a >= d else a  # noqa: E731
        joined = self._joined(ins, None, nd, "stacked")
        if isinstance(joined, Split):
            return [Split(shift(joined.axis), joined.origins)]
        if joined is not None:
            return [joined]
        vary = frozenset(shift(a) for s in ins if isinstance(s, Rep) for a in s.vary)
        return [Rep(vary | ({d} if vary else frozenset()))]

    def op_unstack(self, eqn, ins):
        """``jnp.unstack`` (stack's transpose): one output per index of ``axis``, that axis gone."""
        (s,) = ins
        d = eqn.params["axis"]
        keep = [i for i in range(len(_shape(eqn.invars[0]))) if i != d]
        if isinstance(s, Split) and s.axis == d:
            self.conflict(s.origins, "its split output is cut into pieces along its split axis (unstack)")
            return [Rep(_all(len(keep))) for _ in eqn.outvars]
        if isinstance(s, Split):
            return [Split(keep.index(s.axis), s.origins) for _ in eqn.outvars]
        if isinstance(s, Par):  # one layer of a stacked parameter
            return [Par(s.leaf, tuple(s.axes[i] for i in keep)) for _ in eqn.outvars]
        return [Rep(frozenset(keep.index(a) for a in s.vary if a != d)) for _ in eqn.outvars]

    def op_dynamic_update_slice(self, eqn, ins):
        op, upd = ins[0], ins[1]
        nd = len(_shape(eqn.outvars[0]))
        if isinstance(op, Split) or isinstance(upd, Split):
            a = op.axis if isinstance(op, Split) else upd.axis
            full = _shape(eqn.invars[0])[a] == _shape(eqn.invars[1])[a]
            if isinstance(op, Split) and isinstance(upd, Split) and op.axis == upd.axis and full:
                return [Split(a, op.origins | upd.origins)]
            origins = frozenset().union(*(s.origins for s in (op, upd) if isinstance(s, Split)))
            self.conflict(origins, "its split output is written into a replicated buffer")
            return [Rep(_all(nd))]
        vary = frozenset().union(*(s.vary for s in (op, upd) if isinstance(s, Rep)))
        return [Rep(_all(nd) if vary else frozenset())]

    def op_iota(self, eqn, ins):
        return [CONST]

    # ---- reductions ----------------------------------------------------------------------------
    def _reduce(self, eqn, s, axes, what):
        nd_in = len(_shape(eqn.invars[0]))
        keep = [i for i in range(nd_in) if i not in axes]
        if isinstance(s, Split):
            if s.axis in axes:
                size = _shape(eqn.invars[0])[s.axis]
                if size == self.width or size in self.channel_widths:
                    self.conflict(s.origins, f"it is reduced over the model width ({what}, e.g. a norm)",
                                  taint=False)
                # reduced to a scalar (a loss) ends the program; per-token values left are the
                # reductions a split of a router's scores would pay for
                whole = all(_shape(eqn.invars[0])[a] == 1 for a in keep)
                self.split_ends.note(s.origins, KEPT if whole else REDUCED)
                return Rep(_all(len(keep)))
            return Split(keep.index(s.axis), s.origins)
        if isinstance(s, Par):
            return CONST
        return Rep(frozenset(keep.index(a) for a in s.vary if a in keep))

    def _reduce_op(self, eqn, ins):
        axes = tuple(a % len(_shape(eqn.invars[0])) for a in eqn.params["axes"])
        return [self._reduce(eqn, ins[0], axes, eqn.primitive.name)]

    op_reduce_sum = op_reduce_max = op_reduce_min = op_reduce_prod = _reduce_op
    op_reduce_and = op_reduce_or = op_reduce_xor = op_argmax = op_argmin = _reduce_op

    def _cumulative(self, eqn, ins):
        axis = eqn.params["axis"]
        return [self._slice_like(eqn, ins[0], [i != axis for i in range(len(_shape(eqn.invars[0])))])]

    op_cumsum = op_cumprod = op_cummax = op_cummin = op_cumlogsumexp = _cumulative

    def op_sort(self, eqn, ins):
        dim = eqn.params["dimension"]
        full = [i != dim for i in range(len(_shape(eqn.invars[0])))]
        return [self._slice_like(eqn, s, full) for s in ins]

    def op_top_k(self, eqn, ins):
        nd = len(_shape(eqn.invars[0]))
        out = self._slice_like(eqn, ins[0], [i != nd - 1 for i in range(nd)])
        return [out, out if isinstance(out, Split) else Rep(out.vary if isinstance(out, Rep) else frozenset())]

    # ---- lookups -------------------------------------------------------------------------------
    def op_gather(self, eqn, ins):
        op, idx = ins[0], ins[1]
        dn = eqn.params["dimension_numbers"]
        op_shape, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
        nd = len(out_shape)
        slice_sizes = eqn.params["slice_sizes"]
        m = _gather_maps(dn, len(op_shape), len(_shape(eqn.invars[1])), nd)
        offset_map = m["window"]  # operand axis -> output axis (a slice of it)
        if isinstance(idx, Split):
            return [self._split_indices(eqn, op, idx, m)]
        data = bool(idx.vary)
        if isinstance(op, Par):
            indexed = [a for a in dn.start_index_map]
            if not data:  # a constant index: a layer of a stacked parameter, a position table
                axes = [None] * nd
                for a, o in offset_map.items():
                    if slice_sizes[a] == op_shape[a]:
                        axes[o] = op.axes[a]
                for a, o in m["batching"].items():  # element i of the axis goes to output i
                    axes[o] = op.axes[a]
                return [Par(op.leaf, tuple(axes))]
            self.embedding(op, indexed, offset_map, op_shape, slice_sizes)
            return [Rep(_all(nd))]
        if isinstance(op, Split):
            a = op.axis
            if a in m["batching"]:  # per-head blocks gathered per head (vmap, take_along_axis)
                return [Split(m["batching"][a], op.origins)]
            if a in offset_map and slice_sizes[a] == op_shape[a]:
                return [Split(offset_map[a], op.origins)]
            if a in dn.start_index_map or a in dn.collapsed_slice_dims:
                self.split_ends.note(op.origins, REDUCED)
                return [Rep(_all(nd))]  # a pick along the split axis: XLA masks and all-reduces
            self.conflict(op.origins, "it is gathered along its split axis")
            return [Rep(_all(nd))]
        return [Rep(_all(nd) if (op.vary or data) else frozenset())]

    def _split_indices(self, eqn, op, idx, m):
        """Gather indices split along one of their batch axes: each shard gathers its own rows,
        from an operand that is replicated or split along the paired batching axis."""
        nd = len(_shape(eqn.outvars[0]))
        o = m["index"].get(idx.axis)  # None: the index vector axis
        paired = {i: a for a, i in m["index_of"].items()}.get(idx.axis)
        if o is not None and isinstance(op, Rep):  # each shard gathers from its whole copy
            return Split(o, idx.origins)
        if o is not None and isinstance(op, Split) and op.axis == paired:
            return Split(o, idx.origins | op.origins)
        self.conflict(idx.origins, "it is used as gather indices")
        if isinstance(op, Split):
            self.conflict(op.origins, "it is gathered by indices split another way")
        return Rep(_all(nd))

    def embedding(self, op, indexed, offset_map, op_shape, slice_sizes):
        """A parameter looked up by data-dependent indices: split the vocabulary, else hidden."""
        n = self.n
        leaf = op.leaf
        if leaf in self.final:
            return
        cands = [op.axes[a] for a in indexed if op.axes[a] is not None and op_shape[a] % n == 0]
        kind = "embedding-vocab"
        rows = min((op_shape[a] for a in indexed), default=0)
        if not cands and rows < n:
            # a table of fewer rows than shards (token types, segments) is tiny: split on hidden
            # it would split the stream it is added to (measured: BERT 1.6x Megatron's traffic)
            self.undivisible[leaf] = (f"an embedding of {rows} rows, fewer than the {n} model "
                                      "shards: too small to split")
            return
        if not cands:
            cands = [op.axes[a] for a in offset_map if op.axes[a] is not None
                     and slice_sizes[a] == op_shape[a] and op_shape[a] % n == 0]
            kind = "embedding-hidden"
        if not cands:
            self.undivisible[leaf] = (f"embedding dimensions {tuple(op_shape)} are not divisible by {n}")
            return
        if leaf in self.decided and self.decided[leaf][0] in cands:
            return
        self.candidates.setdefault(leaf, cands)
        i = self.choice.get(leaf, 0)
        if i < len(cands):
            self.decide(leaf, cands[i], kind)

    def op_scatter_add(self, eqn, ins):
        """scatter, scatter-add/mul/min/max: the output is the operand with the updates written
        in. A split passes through on an operand axis that the updates cover whole (a window
        axis) or element by element (a batching axis, as vmap writes per head), when the operand
        and the updates are each split along their copy of that axis or constant along it, and
        the indices are split along their copy (a batching axis) or not split."""
        op_shape = _shape(eqn.invars[0])
        nd = len(op_shape)
        m = _scatter_maps(eqn.params["dimension_numbers"], op_shape, _shape(eqn.invars[2]))
        copies = [{a: a for a in range(nd)}, m["index_of"], m["updates_of"]]  # operand axis -> own
        splits = [(k, s) for k, s in enumerate(ins[:3]) if isinstance(s, Split)]
        if not splits:
            data = any(isinstance(s, Rep) and s.vary for s in ins[:3])
            return [Rep(_all(nd) if data else frozenset())]
        origins = frozenset().union(*(s.origins for _, s in splits))
        targets = {next((a for a, c in copies[k].items() if c == s.axis), None) for k, s in splits}
        a = targets.pop() if len(targets) == 1 else None
        if a is None or a not in copies[2]:
            self.conflict(origins, "its split output is scattered along its split axis")
            return [Rep(_all(nd))]
        for k in (0, 2):  # operand, updates
            s = ins[k]
            if isinstance(s, Rep) and copies[k][a] in s.vary:
                self.conflict(origins, "its split output is scattered into (or with) a replicated "
                                       "activation, which would need an all-gather")
                return [Rep(_all(nd))]
        return [Split(a, origins)]

    op_scatter = op_scatter_mul = op_scatter_min = op_scatter_max = op_scatter_add

    # ---- matmuls -------------------------------------------------------------------------------
    def op_dot_general(self, eqn, ins):
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if not lc and not rc:
            return [self.broadcast_product(eqn, ins)]
        lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
        shapes = [_shape(eqn.invars[0]), _shape(eqn.invars[1])]
        out_nd = len(_shape(eqn.outvars[0]))
        contract, batch = (lc, rc), (lb, rb)
        free = [[i for i in range(len(shapes[k])) if i not in contract[k] and i not in batch[k]]
                for k in (0, 1)]

        positions = output_axes(eqn)

        def out_axis(k, axis):
            return positions[(k, axis)]

        def role(k, axis):
            if axis in contract[k]:
                return "contract", contract[k].index(axis)
            if axis in batch[k]:
                return "batch", batch[k].index(axis)
            return "free", None

        l, r = ins
        if isinstance(l, Par) and isinstance(r, Par):
            return [CONST]
        if isinstance(l, Par) or isinstance(r, Par):
            w = 0 if isinstance(l, Par) else 1
            self.weight_of.setdefault(eqn, set()).add((ins[w].leaf, ins[w].axes))
            return [self.param_matmul(eqn, ins[w], ins[1 - w], w, shapes, contract, batch, free,
                                      out_axis, role, out_nd)]
        # activation x activation (attention scores, per-head values, expert combine)
        splits = [(k, s) for k, s in enumerate(ins) if isinstance(s, Split)]
        if not splits:
            vary = any(s.vary for s in ins)
            return [Rep(_all(out_nd) if vary else frozenset())]
        origins = frozenset().union(*(s.origins for _, s in splits))
        roles = [(k, role(k, s.axis)) for k, s in splits]
        if len(splits) == 2:
            (_, ra), (_, rb2) = roles
            if ra == rb2 and ra[0] == "batch":
                return [Split(ra[1], origins)]
            bad = [s for (_, s), (_, r) in zip(splits, roles) if r[0] != "batch"] or [s for _, s in splits]
            self.conflict_among(bad, "two activations split on axes other than a shared batch axis "
                                   "meet in a matmul (e.g. head_dim in the attention scores)")
            return [Rep(_all(out_nd))]
        (k, s), (_, (kind, _)) = splits[0], roles[0]
        if kind == "batch":  # the other side is sliced locally (K/V heads repeated for GQA)
            return [Split(out_axis(k, s.axis), origins)]
        if kind == "contract":  # the other side is sliced locally; partial sums all-reduced
            self.split_ends.note(origins, KEPT)
            return [Rep(_all(out_nd))]  # (the expert combine of a MoE)
        self.conflict(origins, "an activation split on a non-batch axis meets a replicated one in "
                               "a matmul (e.g. values split on head_dim)")
        return [Rep(_all(out_nd))]

    def broadcast_product(self, eqn, ins):
        """A ``dot_general`` that contracts nothing (an einsum that only multiplies: rotary
        embeddings written ``einsum("bslh,...sh->bslh", q, cos)``) is a broadcasting multiply:
        each output element is one element of each operand, so splits pass through as they do
        through ``q * cos``. Each operand is laid over the output's axes (where
        :func:`output_axes` puts its own, the others broadcast) and combined elementwise."""
        nd = len(_shape(eqn.outvars[0]))
        positions = output_axes(eqn)
        full = []
        for k, s in enumerate(ins):
            to = {a: positions[(k, a)] for a in range(len(_shape(eqn.invars[k])))}
            if isinstance(s, Split):
                s = Split(to[s.axis], s.origins)
            elif isinstance(s, Par):
                axes = [None] * nd
                for a, pa in enumerate(s.axes):
                    axes[to[a]] = pa
                s = Par(s.leaf, tuple(axes))
            else:
                src = s.src and (s.src[0], {to[a]: pa for a, pa in s.src[1].items()}, s.src[2])
                s = Rep(frozenset(to[a] for a in s.vary), src, s.tainted)
            full.append(s)
        return self.combine(full, nd)

    def param_matmul(self, eqn, w, x, wk, shapes, contract, batch, free, out_axis, role, out_nd):
        xk = 1 - wk
        n = self.n
        leaf = w.leaf
        pshape = self.shapes[leaf]
        self.used.add(leaf)
        # if the output stays replicated, this parameter could still split its output axis to
        # follow a split it is added to (a LoRA B matrix next to its column-parallel base)
        src = (leaf, {out_axis(wk, a): w.axes[a] for a in free[wk] if w.axes[a] is not None},
               x.origins if isinstance(x, Split) else frozenset())
        if isinstance(x, Split):
            kind, pos = role(xk, x.axis)
            if kind == "contract":
                wa = contract[wk][pos]
                pa = w.axes[wa]
                if pa is None or leaf in self.final or pshape[pa] % n:
                    why = self.final.get(leaf) or self.undivisible.get(leaf) or "its layout hides the split axis"
                    self.conflict(x.origins, f"the next matmul's parameter cannot be split ({why})", taint=False)
                    return Rep(_all(out_nd), src)
                if leaf in self.wish and self.wish[leaf] != pa:
                    self.conflict(x.origins, "the next matmul's parameter follows another split", taint=False)
                    return Rep(_all(out_nd), src)
                if leaf in self.decided and self.decided[leaf][0] != pa:
                    self.conflict(x.origins, "the next matmul's parameter is split another way", taint=False)
                else:
                    self.decide(leaf, pa, "row")
                self.split_ends.note(x.origins, KEPT)
                # the row-parallel output is replicated in any placement, unless its input's
                # split is already in conflict (then the matmul may read it whole and split)
                self.clean_out = not x.origins & self.blamed.keys()
                return Rep(_all(out_nd), src)
            if kind == "batch":
                wa = batch[wk][pos]
                pa = w.axes[wa]
                if pa is not None and leaf not in self.final and pshape[pa] % n == 0:
                    self.decide(leaf, pa, "batch")
                return Split(out_axis(xk, x.axis), x.origins)
            return Split(out_axis(xk, x.axis), x.origins)
        # x replicated
        if leaf in self.final:
            return Rep(_all(out_nd), src)
        xc = contract[xk]
        if xc and not any(a in x.vary for a in xc) and x.vary:
            # a one-hot (data-constant along the contracted axis): the vocabulary-parallel lookup
            cands = [w.axes[a] for a in contract[wk] if w.axes[a] is not None and pshape[w.axes[a]] % n == 0]
            if cands:
                self.candidates.setdefault(leaf, cands)
                i = self.choice.get(leaf, 0)
                if i < len(cands) and self.decide(leaf, cands[i], "embedding-vocab"):
                    return Rep(_all(out_nd))
        cands = self.column_candidates(leaf, w, shapes[wk], batch[wk], free[wk])
        i = self.choice.get(leaf, 0)
        if i >= len(cands):
            return Rep(_all(out_nd), src)
        pa = cands[i]
        wa = w.axes.index(pa)
        if not self.decide(leaf, pa, "batch" if wa in batch[wk] else "column"):
            return Rep(_all(out_nd))
        if wa not in batch[wk]:
            self.split_ends.column(leaf, pshape[pa], math.prod(shapes[wk][a] for a in contract[wk]))
        return Split(out_axis(wk, wa), frozenset([leaf]))

    def column_candidates(self, leaf, w, wshape, wbatch, wfree):
        """Parameter axes to split when ``w`` reads a replicated activation, best first.

        Batch axes (experts) first, then output axes major-first (heads before head_dim, heads
        before the Q/K/V axis of a fused kernel when that does not divide); a choice that leads
        to a conflict (head_dim contracted in the attention scores) is replaced by the next.
        """
        n = self.n
        pshape = self.shapes[leaf]
        free = [a for a in wfree if w.axes[a] is not None]
        free.sort(key=lambda a: w.axes[a])
        order = [a for a in wbatch if w.axes[a] is not None] + free
        cands = [w.axes[a] for a in order if pshape[w.axes[a]] % n == 0 and wshape[a] % n == 0]
        if leaf in self.wish and self.wish[leaf] in [w.axes[a] for a in wfree + list(wbatch)]:
            cands = [self.wish[leaf]] + [c for c in cands if c != self.wish[leaf]]
        if not cands and not order:
            self.undivisible[leaf] = ("no output axis of its matmul is a whole axis of the parameter "
                                      f"(e.g. repeated before the matmul) that {n} shards can split")
        elif not cands:
            sizes = [pshape[w.axes[a]] for a in order]
            self.undivisible[leaf] = (f"output dimension{'s' if len(sizes) > 1 else ''} "
                                      f"{', '.join(map(str, sizes))} not divisible by {n}")
        prev = self.candidates.get(leaf)
        if prev is None or len(cands) > len(prev):
            self.candidates[leaf] = cands
        return cands

    # ---- convolutions --------------------------------------------------------------------------
    # A convolution is a dense layer over its channel axes, applied at every position: the
    # kernel's O axis (rhs_spec[0]) is a matmul's output axis, its I axis (rhs_spec[1]) the
    # contracted one, so Megatron's rules split output channels of one convolution and input
    # channels of the next. A grouped convolution (feature_group_count G) is G convolutions side
    # by side: split by whole groups, its input, kernel and output channels split alike.
    def op_conv_general_dilated(self, eqn, ins):
        """A convolution with a parameter kernel: row-parallel on an input split on its
        channels, column-parallel on a replicated one, grouped ones by whole groups."""
        x, w = ins
        if eqn.params["batch_group_count"] > 1 or not isinstance(w, Par) or isinstance(x, Par):
            # a kernel computed from data (or a batch-grouped one, as in a kernel gradient)
            return self.unknown(eqn, ins, "a convolution whose kernel is not a parameter")
        dn = eqn.params["dimension_numbers"]
        out_nd = len(_shape(eqn.outvars[0]))
        self.used.add(w.leaf)
        self.channel_widths.update((_shape(eqn.invars[0])[dn.lhs_spec[1]],
                                    _shape(eqn.outvars[0])[dn.out_spec[1]]))
        if isinstance(x, Split) and x.axis != dn.lhs_spec[1]:
            if x.axis == dn.lhs_spec[0]:  # split over the batch: every example convolved alone
                return [Split(dn.out_spec[0], x.origins)]
            self.conflict(x.origins, "a convolution's window runs over its split (spatial) axis")
            return [Rep(_all(out_nd))]
        if eqn.params["feature_group_count"] > 1:
            return [self.grouped_conv(eqn, x, w, dn, out_nd)]
        if isinstance(x, Split):  # input channels split: row-parallel, the output all-reduced
            return [self.conv_row(eqn, x, w, dn, out_nd)]
        return [self.conv_column(eqn, w, dn, out_nd, "column")]

    @property
    def channel_widths(self):
        """The channel counts of the convolutions seen: a split of one of them reduced away
        (a LayerNorm over the channels) is a norm over the model width (see :meth:`_reduce`)."""
        return self.__dict__.setdefault("_channel_widths", set())

    def _conv_axis(self, eqn, w, kernel_axis):
        """The parameter axis of the kernel's ``kernel_axis`` if ``self.n`` shards divide it
        (as the kernel is stored and as the convolution sees it), else None."""
        pa = w.axes[kernel_axis]
        if pa is None or self.shapes[w.leaf][pa] % self.n or _shape(eqn.invars[1])[kernel_axis] % self.n:
            return None
        return pa

    def conv_row(self, eqn, x, w, dn, out_nd):
        """A convolution reading input channels split over the shards: its kernel's I axis is
        split to match, each shard sums its channels, the output is all-reduced (replicated)."""
        leaf = w.leaf
        src = self._conv_src(w, dn, x.origins)
        pa = self._conv_axis(eqn, w, dn.rhs_spec[1])
        if pa is None or leaf in self.final:
            why = (self.final.get(leaf) or self.undivisible.get(leaf)
                   or f"its input channels ({_shape(eqn.invars[1])[dn.rhs_spec[1]]}) are not "
                      f"divisible by {self.n}")
            self.conflict(x.origins, f"the next convolution's kernel cannot be split ({why})", taint=False)
            return Rep(_all(out_nd), src)
        if leaf in self.wish and self.wish[leaf] != pa:
            self.conflict(x.origins, "a convolution reading it is asked to split its output channels "
                                     "instead, to follow a split it is added to", taint=False)
            return Rep(_all(out_nd), src)
        if leaf in self.decided and self.decided[leaf][0] != pa:
            self.conflict(x.origins, "the next convolution's kernel is split another way", taint=False)
        else:
            self.decide(leaf, pa, "row")
        self.split_ends.note(x.origins, KEPT)
        self.clean_out = not x.origins & self.blamed.keys()  # as param_matmul's row case
        return Rep(_all(out_nd), src)

    def _conv_src(self, w, dn, upstream):
        """A replicated convolution output's ``Rep.src``: the kernel could split its output
        channels to follow a split it is added to (a projection shortcut beside a block), as
        :meth:`residual_meet` weighs against giving up the splits upstream."""
        pa = w.axes[dn.rhs_spec[0]]
        return None if pa is None else (w.leaf, {dn.out_spec[1]: pa}, upstream)

    def conv_column(self, eqn, w, dn, out_nd, kind):
        """A convolution reading a replicated input: split its output channels (the kernel's O
        axis) if they divide, the output split on its feature axis; else replicated."""
        leaf = w.leaf
        src = self._conv_src(w, dn, frozenset())
        if leaf in self.final:
            return Rep(_all(out_nd), src)
        pa = self._conv_axis(eqn, w, dn.rhs_spec[0])
        cands = [] if pa is None else [pa]
        if leaf in self.wish and self.wish[leaf] == pa:  # asked to follow a split: nothing else
            cands = [pa]
        if not cands and leaf not in self.undivisible:
            self.undivisible[leaf] = (f"output channels {_shape(eqn.invars[1])[dn.rhs_spec[0]]} "
                                      f"not divisible by {self.n}")
        if len(cands) > len(self.candidates.get(leaf, ())):
            self.candidates[leaf] = cands
        if self.choice.get(leaf, 0) >= len(cands):
            return Rep(_all(out_nd), src)
        if not self.decide(leaf, pa, kind):
            return Rep(_all(out_nd))
        return Split(dn.out_spec[1], frozenset([leaf]))

    def grouped_conv(self, eqn, x, w, dn, out_nd):
        """A grouped convolution, split by whole groups when the shards divide them: input,
        kernel O and output channels split alike, no communication. On a replicated input
        it starts a split as a column-parallel layer does; on a split one it carries it on."""
        leaf, groups = w.leaf, eqn.params["feature_group_count"]
        if groups % self.n:
            self.undivisible[leaf] = (f"a grouped convolution of {groups} groups, not divisible "
                                      f"by {self.n} shards")
            if isinstance(x, Split):
                self.conflict(x.origins, f"the next convolution's kernel cannot be split "
                                         f"({self.undivisible[leaf]})", taint=False)
            return Rep(_all(out_nd))
        if not isinstance(x, Split):
            return self.conv_column(eqn, w, dn, out_nd, "conv-groups")
        pa = self._conv_axis(eqn, w, dn.rhs_spec[0])  # O = groups x outputs per group: divides
        if pa is None or leaf in self.final:
            why = self.final.get(leaf) or "its layout hides the output channels"
            self.conflict(x.origins, f"the next grouped convolution's kernel cannot be split ({why})",
                          taint=False)
            return Rep(_all(out_nd))
        if leaf in self.decided and self.decided[leaf][0] != pa:
            self.conflict(x.origins, "the next grouped convolution's kernel is split another way",
                          taint=False)
            return Rep(_all(out_nd))
        self.decide(leaf, pa, "conv-groups")
        return Split(dn.out_spec[1], x.origins)

    def _pool(self, eqn, ins):
        """A pooling window (avg_pool, max_pool): each channel pooled alone, so a split on an
        axis the window neither spans, strides, dilates nor pads passes through."""
        p = eqn.params
        full = [p["window_dimensions"][i] == 1 and p["window_strides"][i] == 1
                and tuple(p["padding"][i]) == (0, 0) and p["base_dilation"][i] == 1
                and p["window_dilation"][i] == 1 for i in range(len(_shape(eqn.invars[0])))]
        return [self._slice_like(eqn, ins[0], full)]

    op_reduce_window_sum = op_reduce_window_max = op_reduce_window_min = _pool

    # ---- control flow ----------------------------------------------------------------------------
    def _carry(self, ins, outs, outvars, recurrent_steps=None):
        """Loop carries must keep their placement from one iteration to the next.
        ``recurrent_steps``: the loop applies the same weights at every step (a recurrent
        cell), over that many steps."""
        res = []
        for a, b, v in zip(ins, outs, outvars):
            if isinstance(b, Split) and (not isinstance(a, Split) or a.axis != b.axis):
                if recurrent_steps:
                    self.recurrent_state(b.origins, _shape(v), recurrent_steps)
                else:
                    self.conflict(b.origins, "it would change a loop carry's placement")
                res.append(Rep(_all(len(_shape(v)))))
            elif isinstance(a, Split) and not isinstance(b, Split):
                self.conflict(a.origins, "it would change a loop carry's placement")
                res.append(b)
            else:
                res.append(b)
        return res

    def recurrent_state(self, origins, shape, steps):
        """A split that would become a loop's carry: the state of a recurrent cell (an LSTM's h
        and c, from gates of Dense kernels). Every parameter whose split made it is kept whole,
        not only the first decided (as :meth:`conflict` blames): once one gate is whole, the
        next would be blamed for meeting it, one round and one untrue reason at a time."""
        over = f"{steps} steps" if steps else "its iterations"
        reason = (f"a recurrent cell's weight, its output updates a loop carry (the recurrent "
                  f"state {list(shape)}, over {over}): split by hidden units, the state would "
                  f"be all-gathered at every step, forward and backward")
        for leaf in origins:
            self.blamed.setdefault(leaf, reason)
        self.taint_out = True

    def op_scan(self, eqn, ins):
        p = eqn.params
        nc, ncarry, _ = scan_operand_groups(eqn)
        consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
        xs_in = []
        for s, v in zip(xs, eqn.invars[nc + ncarry:]):
            if isinstance(s, Split):
                if s.axis == 0:
                    self.conflict(s.origins, "a scan runs over its split axis")
                    xs_in.append(Rep(_all(len(_shape(v)) - 1)))
                else:
                    xs_in.append(Split(s.axis - 1, s.origins))
            elif isinstance(s, Par):
                xs_in.append(Par(s.leaf, s.axes[1:]))
            else:
                xs_in.append(Rep(frozenset(a - 1 for a in s.vary if a > 0)))
        recurrent = any(isinstance(c, Par) for c in consts) and not any(isinstance(x, Par)
                                                                         for x in xs)
        if recurrent:
            # the same weights at every step (a recurrent cell, not a scan over stacked layers):
            # past the first step, a replicated carry is the state, data in every element
            carry = [Rep(_all(len(_shape(v))), state=(_shape(v), p["length"]))
                     if isinstance(c, Rep) else c
                     for c, v in zip(carry, eqn.invars[nc:nc + ncarry])]
        outs = self.eval_closed(p["jaxpr"], consts + carry + xs_in)
        carry_out = self._carry(carry, outs[:ncarry], eqn.outvars[:ncarry],
                                p["length"] if recurrent else None)
        ys = []
        for s in outs[ncarry:]:
            if isinstance(s, Split):
                ys.append(Split(s.axis + 1, s.origins))
            elif isinstance(s, Par):
                ys.append(Par(s.leaf, (None,) + s.axes))
            else:
                ys.append(Rep(frozenset([0] + [a + 1 for a in s.vary]) if s.vary else frozenset()))
        return carry_out + ys

    def op_while(self, eqn, ins):
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        self.eval_closed(p["cond_jaxpr"], cconsts + carry)
        outs = self.eval_closed(p["body_jaxpr"], bconsts + carry)
        return self._carry(carry, outs, eqn.outvars)

    def op_cond(self, eqn, ins):
        branches = eqn.params["branches"]
        results = [self.eval_closed(b, ins[1:]) for b in branches]
        outs = []
        for i, v in enumerate(eqn.outvars):
            states = [r[i] for r in results]
            if all(s == states[0] for s in states):
                outs.append(states[0])
                continue
            splits = [s for s in states if isinstance(s, Split)]
            if splits:
                self.conflict(frozenset().union(*(s.origins for s in splits)),
                              "the branches of a cond place it differently")
            outs.append(Rep(_all(len(_shape(v)))))
        return outs

    # ---- the result ----------------------------------------------------------------------------
    def placement(self, leaf):
        """(parameter axis or None, reason)."""
        shape = self.shapes[leaf]
        if leaf in self.final:
            return None, "replicated: " + self.final[leaf]
        if leaf in self.follow_conflicts:
            return None, "replicated: " + self.follow_conflicts[leaf]
        if leaf in self.decided:
            axis, kind, _ = self.decided[leaf]
            size = shape[axis]
            text = {
                "column": f"column-parallel: output axis {axis} (size {size}) split; reads the replicated stream",
                "row": f"row-parallel: contracted axis {axis} (size {size}) split; its output is all-reduced",
                "batch": f"expert/batch axis {axis} (size {size}) split",
                "embedding-vocab": f"embedding: vocabulary axis {axis} (size {size}) split",
                "embedding-hidden": f"embedding: hidden axis {axis} (size {size}) split (vocabulary not divisible)",
                "follow": f"axis {axis} (size {size}) split with the output it is added to",
                "conv-groups": f"grouped convolution: output channels (axis {axis}, size {size}) split by whole groups; input and output channels split alike",
            }[kind]
            return axis, text
        if leaf in self.undivisible:
            return None, "replicated: " + self.undivisible[leaf]
        if leaf in self.used:
            return None, "replicated: its matmul needs no split here"
        return None, "replicated: not a matmul weight (norm, scale, bias of a replicated output, or unused)"


def _kv_head_groups(analysis):
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


def _abstract(tree):
    def to_sds(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
        return x
    return jax.tree_util.tree_map(to_sds, tree)


def dataflow_placements(fn, params, *example_args, n_model_shards, group_kv_heads=True):
    """One :class:`Placement` per leaf of ``params`` (written order), from ``fn``'s data flow.

    ``fn(params, *example_args)`` is any function of the parameters — the forward pass or the
    loss; the args may be arrays or ``jax.ShapeDtypeStruct``s (nothing is computed). With
    ``group_kv_heads``, K/V with fewer heads than shards are split over groups of shards (see
    :func:`_kv_head_groups`), else replicated. Raises :class:`DataflowError` if ``fn`` cannot be
    traced.
    """
    leaves = leaves_in_written_order(params)
    n = n_model_shards
    if n == 1:
        return [Placement(path, tuple(np.shape(x)), getattr(x, "dtype", np.float32), P(),
                          "replicated (one model shard)") for path, x in leaves]
    flat = leaves_with_paths(params)
    try:
        closed = jax.make_jaxpr(laid_out_for(fn, n, vendor_kernels=False))(_abstract(params), *_abstract(example_args))
    except Exception as e:  # noqa: BLE001 - any tracing failure means: use the structural rules
        raise DataflowError(f"could not trace the model: {type(e).__name__}: {e}") from e
    shapes = [tuple(np.shape(x)) for _, x in flat]
    if len(closed.jaxpr.invars) < len(flat):
        raise DataflowError("the traced function has fewer inputs than params has leaves")
    width = model_width([s for s in shapes])
    analysis = _Analysis(closed, len(flat), shapes, n, width)
    analysis.run()
    index = {path: i for i, (path, _) in enumerate(flat)}
    kv_groups = _kv_head_groups(analysis) if group_kv_heads else {}
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
                             weight))
    return out


FALLBACK = "shapes and order only"  # how traced_placements names the fallback plan's source


def traced_placements(fn, params, *example_args, n_model_shards, group_kv_heads=True):
    """``(placements, where they came from)`` by :func:`dataflow_placements`, or ``(None, why
    not)`` when the analysis cannot follow ``fn`` (the caller then keeps the shape rules)."""
    try:
        return (dataflow_placements(fn, params, *example_args, n_model_shards=n_model_shards,
                                    group_kv_heads=group_kv_heads), "the traced data flow")
    except Exception as e:  # noqa: BLE001 - any program the analysis cannot follow
        return None, f"{FALLBACK} (the data-flow analysis failed: {type(e).__name__}: {e})"
