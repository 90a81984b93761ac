"""The analysis of one traced program: walked until no split conflicts, each operation followed
by its rule (``rules``: {primitive name: rule(flow, eqn, ins)}), the splits decided, given up
and blamed."""

import dataclasses
import math
import os

import numpy as np
from jax.extend import core as jcore

from ..interpreter import REMATS, follow, opened, sub_programs, total
from ..split_ends import KEPT, SplitEnds
from .recurrent import cell_cost, split_by_hidden_units
from .values import CONST, DataflowError, Par, Rep, Split, all_axes, shape_of

MAX_ROUNDS = 100
MET_REPLICATED = "its split output is added to a replicated activation"
_DEBUG = bool(os.environ.get("REDCOAST_DATAFLOW_DEBUG"))


class Analysis:
    """One analysis of a traced program: its walks, the splits decided and given up, and the
    conflicts; ``rules`` ({primitive name: rule(flow, eqn, ins)}) follow each operation."""

    def __init__(self, closed, n_params, leaf_shapes, n, width, rules, link_costs=None):
        self.rules = rules
        self.link_costs = link_costs  # recurrent.LinkCosts: what a recurrent cell's split costs
        self.closed = closed
        self.n_params = n_params
        self.shapes = leaf_shapes
        self.n = n
        self.width = width
        self.choice = {}       # leaf -> index of the candidate axis to try
        self.final = {}        # leaf -> reason it is replicated (candidates exhausted)
        self.routing = {}      # leaf -> the split_ends reason it was blamed with (a router)
        self.wish = {}         # leaf -> parameter axis another split asks it to follow
        self.candidates = {}   # leaf -> [parameter axes] tried as column splits
        self.undivisible = {}  # leaf -> reason no candidate divided
        self.cells = {}        # scan eqn -> its recurrent.CellCost (None: no rates to weigh)
        self.cell_notes = {}   # leaf -> why its recurrent cell is split by hidden units

    # ---- walks over the program until nothing conflicts -----------------------------------
    def run(self):
        """Walk until no split conflicts; then once more with the weights given up for meeting
        a replicated value reopened. A blame is made on what was decided before it in the same
        walk; a split decided earlier and given up later (a U-Net's stem, whose output is
        concatenated with the decoder's) may have made the replicated value it met (the row-
        parallel output of a convolution that reads the stem's split). Reopened, such a weight
        splits once that cause is gone; the second plan is kept if it replicates fewer bytes."""
        self._converge()
        reopen = [leaf for leaf, why in self.final.items() if why.startswith(MET_REPLICATED)]
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
            self.reductions = set()  # equations whose output Megatron's split all-reduces
            self.split_cells = {}    # scan eqn -> the CellCost of a cell split by hidden units
            self.follow_conflicts = {}
            self.tentative = set()
            self.tainted_now = self.taint_out = self.clean_out = False
            self.jaxprs = {}       # id -> every (sub)program walked, for the K/V group pass
            self.weight_of = {}    # matmul eqn -> {(leaf, parameter axis of each operand axis)}
            ins = [Par(i, tuple(range(len(self.shapes[i])))) for i in range(self.n_params)]
            ins += [Rep(all_axes(len(shape_of(v)))) for v in self.closed.jaxpr.invars[self.n_params:]]
            outs = self.eval_closed(self.closed, ins)
            returned = [s.origins for s in outs if isinstance(s, Split)]
            self.split_ends.note(frozenset().union(*returned), KEPT)  # outputs are used split
            for leaf, reason in self.split_ends.blames(self.is_split).items():
                self.blamed.setdefault(leaf, reason)
                self.routing[leaf] = reason
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
        """The values of ``closed``'s outputs from its inputs' (``ins``); its constants and
        literals are replicated constants."""
        jaxpr = opened(closed)[0]
        self.jaxprs[id(jaxpr)] = jaxpr

        def step(eqn, states):
            states = [CONST if s is None else s for s in states]
            try:
                return self.eval_eqn(eqn, states)
            except DataflowError:
                raise
            except Exception as e:  # noqa: BLE001 - named, then the caller keeps the shape rules
                raise DataflowError(f"the analysis could not follow the operation "
                                    f"'{eqn.primitive.name}' ({type(e).__name__}: {e})") from e

        env = follow(jaxpr, ins, step)
        return [env.get(v, CONST) if isinstance(v, jcore.Var) else CONST for v in jaxpr.outvars]

    def eval_eqn(self, eqn, ins):
        name = eqn.primitive.name
        rule = self.rules.get(name.replace("-", "_"))
        if name in ("scan", "while", "cond"):
            return rule(self, eqn, ins)
        if rule is not None:
            return self._run_handler(rule, eqn, ins)
        sub = None
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
            if key in eqn.params and eqn.params[key] is not None:
                sub = eqn.params[key]
                break
        if sub is not None and not callable(sub):
            inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
            if len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
                return self.eval_closed(sub, ins)
        rule = Analysis.elementwise_op if len(eqn.outvars) == 1 and self._elementwise(eqn) else Analysis.unknown_op
        return self._run_handler(rule, eqn, ins)

    def _run_handler(self, rule, eqn, ins):
        """Run one operation's rule; replicated outputs of tainted inputs stay tainted."""
        self.tainted_now = any(self._tainted(s) for s in ins)
        self.taint_out = self.clean_out = False
        outs = rule(self, eqn, ins)
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
        out = shape_of(eqn.outvars[0])
        return all(shape_of(v) == () or (len(shape_of(v)) == len(out) and all(
            a in (b, 1) for a, b in zip(shape_of(v), out))) for v in eqn.invars)

    def unknown(self, eqn, ins, what):
        """An op redcoast does not model: a split entering it is a conflict; outputs replicated."""
        for s in ins:
            if isinstance(s, Split):
                self.conflict(s.origins, f"its split output reaches {what}, which would need communication")
        data = any(isinstance(s, (Split,)) or (isinstance(s, Rep) and s.vary) for s in ins)
        return [Rep(all_axes(len(shape_of(v))) if data else frozenset()) for v in eqn.outvars]

    def elementwise(self, eqn, ins):
        out = shape_of(eqn.outvars[0])
        nd = len(out)
        full = []
        split = any(isinstance(s, Split) for s in ins)
        for v, s in zip(eqn.invars, ins):
            shp = shape_of(v)
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
            return Rep(all_axes(nd))
        a = axes.pop()
        state = next((x.state for x in splits + reps if x.state), None)
        for r in reps:
            if a in r.vary:
                if r.state and split_by_hidden_units(r.state[2]):
                    continue  # a cell split by hidden units: its state is split alike
                if state:  # in a recurrent cell: a gate meets the state (a GRU's r * h)
                    self.recurrent_state(origins, *state)
                    return Rep(all_axes(nd))
                if not self.residual_meet(r, a, origins):
                    self.conflict(origins, MET_REPLICATED + " (the residual stream), which "
                                           "would need an all-gather", taint=False)
                    return Rep(all_axes(nd))
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

    # ---- what several kinds of operation share ----------------------------------------------
    def slice_like(self, eqn, s, full):
        """A slice that keeps axes where ``full[i]``; a split on a cut axis is a conflict."""
        nd = len(full)
        if isinstance(s, Split):
            if full[s.axis]:
                return Split(s.axis, s.origins)
            self.conflict(s.origins, f"its split output is sliced along the split axis "
                                     f"({eqn.primitive.name}), e.g. Q, K, V cut out of one fused output")
            return Rep(all_axes(nd))
        if isinstance(s, Par):
            return Par(s.leaf, tuple(p if full[i] else None for i, p in enumerate(s.axes)))
        return Rep(s.vary)

    @property
    def channel_widths(self):
        """The channel counts of the convolutions seen: a split of one of them reduced away
        (a LayerNorm over the channels) is a norm over the model width (see layout_ops.py)."""
        return self.__dict__.setdefault("_channel_widths", set())

    def cell_cost(self, eqn, n_carry):
        """The recurrent.CellCost of splitting the cell the scan ``eqn`` runs (the same in
        every walk: computed once), or None without link costs to weigh it by."""
        if eqn not in self.cells:
            self.cells[eqn] = cell_cost(eqn, n_carry, self.n, self.link_costs)
        return self.cells[eqn]

    def split_cell(self, eqn, cost, weights):
        """The recurrent cell of the scan ``eqn`` is split by hidden units (``cost`` pays):
        its state and outputs are gathered, and ``weights`` (its parameters) say why."""
        self.split_cells[eqn] = cost
        for leaf in weights:
            self.cell_notes[leaf] = f"; a recurrent cell's weight, split by hidden units: {cost.said()}"

    def recurrent_state(self, origins, shape, steps, cost=None):
        """A split that would become a loop's carry: the state of a recurrent cell (an LSTM's h
        and c, from gates of Dense kernels) kept whole, because its split does not pay
        (``cost``, a recurrent.CellCost) or cannot be weighed. Every parameter whose split made
        it is kept whole, not only the first decided (as :meth:`conflict` blames): once one
        gate is whole, the next would be blamed for meeting it, one round and one untrue reason
        at a time."""
        over = f"{steps} steps" if steps else "its iterations"
        reason = (f"a recurrent cell's weight, its output updates a loop carry (the recurrent "
                  f"state {list(shape)}, over {over}): split by hidden units, the state would "
                  f"be all-gathered at every step, forward and backward")
        if cost is not None:
            reason += f", and {cost.said()}"
        for leaf in origins:
            self.blamed.setdefault(leaf, reason)
        self.taint_out = True

    def all_reduced(self, eqn):
        """``eqn``'s output is summed over the model shards under this walk's splits (a
        row-parallel product, a contraction or reduction over a split axis, a lookup in a
        vocabulary split over the shards): one all-reduce forward."""
        self.reductions.add(eqn)

    # ---- the result ----------------------------------------------------------------------------
    def all_reduced_elements(self):
        """Elements of the values the final walk all-reduces over the model shards in one
        forward pass (of the traced batch; elements, not bytes: a compiler may reduce bfloat16
        in float32, XLA:CPU does): each loop's body once per iteration, a rematerialised body
        1.5 times (its forward runs again in the backward pass, which otherwise all-reduces as
        much as the forward: Megatron's conjugate pairs), the costliest branch of a cond."""
        def cost(eqn, total_of):
            name = eqn.primitive.name
            if eqn in self.reductions:
                return math.prod(shape_of(eqn.outvars[0]))
            if name == "scan":
                inside = eqn.params["length"] * total_of(eqn.params["jaxpr"])
                if eqn in self.split_cells:  # its state and outputs gathered and scattered
                    inside += self.split_cells[eqn].reduced_elements
                return inside
            if name == "cond":
                return max(total_of(b) for b in eqn.params["branches"])
            programs = [p for _, _, p in sub_programs(eqn)]
            if name == "while":
                programs = [eqn.params["body_jaxpr"]]
            return (1.5 if name in REMATS else 1) * sum(total_of(p) for p in programs)
        return total(self.closed, cost)

    def routes(self, leaf):
        """Whether ``leaf`` is kept whole because its split output is only ever reduced over
        the split axis (split_ends.py: a router's scores)."""
        return leaf in self.final and self.final[leaf] == self.routing.get(leaf)

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
            return axis, text + self.cell_notes.get(leaf, "")
        if leaf in self.undivisible:
            return None, "replicated: " + self.undivisible[leaf]
        if leaf in self.used:
            return None, "replicated: its matmul needs no split here"
        return None, "replicated: not a matmul weight (norm, scale, bias of a replicated output, or unused)"
