"""Rules for control flow: scan (a recurrent cell when it applies the same weights at every
step), while and cond. A loop carry keeps its placement from one iteration to the next."""

from ..interpreter import scan_operand_groups
from .recurrent import split_by_hidden_units
from .values import Par, Rep, Split, all_axes, shape_of


def _carry(flow, ins, outs, outvars, recurrent_steps=None, cost=None):
    """Loop carries must keep their placement from one iteration to the next.
    ``recurrent_steps``: the loop applies the same weights at every step (a recurrent
    cell), over that many steps; ``cost``: its recurrent.CellCost (a split that pays leaves
    the state split, gathered at every step)."""
    res = []
    for a, b, v in zip(ins, outs, outvars):
        if isinstance(b, Split) and (not isinstance(a, Split) or a.axis != b.axis):
            if not recurrent_steps:
                flow.conflict(b.origins, "it would change a loop carry's placement")
            elif not split_by_hidden_units(cost):  # else the state split by hidden units, gathered each step
                flow.recurrent_state(b.origins, shape_of(v), recurrent_steps, cost)
            res.append(Rep(all_axes(len(shape_of(v)))))
        elif isinstance(a, Split) and not isinstance(b, Split):
            flow.conflict(a.origins, "it would change a loop carry's placement")
            res.append(b)
        else:
            res.append(b)
    return res


def op_scan(flow, eqn, ins):
    p = eqn.params
    nc, ncarry, _ = scan_operand_groups(eqn)
    consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    xs_in = []
    for s, v in zip(xs, eqn.invars[nc + ncarry:]):
        if isinstance(s, Split):
            if s.axis == 0:
                flow.conflict(s.origins, "a scan runs over its split axis")
                xs_in.append(Rep(all_axes(len(shape_of(v)) - 1)))
            else:
                xs_in.append(Split(s.axis - 1, s.origins))
        elif isinstance(s, Par):
            xs_in.append(Par(s.leaf, s.axes[1:]))
        else:
            xs_in.append(Rep(frozenset(a - 1 for a in s.vary if a > 0)))
    recurrent = any(isinstance(c, Par) for c in consts) and not any(isinstance(x, Par)
                                                                     for x in xs)
    cost = flow.cell_cost(eqn, ncarry) if recurrent else None
    split = split_by_hidden_units(cost)
    if recurrent:
        # the same weights at every step (a recurrent cell, not a scan over stacked layers):
        # past the first step, a replicated carry is the state, data in every element
        carry = [Rep(all_axes(len(shape_of(v))), state=(shape_of(v), p["length"], cost))
                 if isinstance(c, Rep) else c
                 for c, v in zip(carry, eqn.invars[nc:nc + ncarry])]
    outs = flow.eval_closed(p["jaxpr"], consts + carry + xs_in)
    carry_out = _carry(flow, carry, outs[:ncarry], eqn.outvars[:ncarry],
                       p["length"] if recurrent else None, cost)
    if split and any(isinstance(s, Split) and s.state for s in outs):
        flow.split_cell(eqn, cost, {c.leaf for c in consts if isinstance(c, Par)})
    ys = []
    for s, v in zip(outs[ncarry:], eqn.outvars[ncarry:]):
        if split and isinstance(s, Split) and s.state:  # the split state's outputs, gathered
            ys.append(Rep(all_axes(len(shape_of(v)))))
        elif isinstance(s, Split):
            ys.append(Split(s.axis + 1, s.origins))
        elif isinstance(s, Par):
            ys.append(Par(s.leaf, (None,) + s.axes))
        else:
            ys.append(Rep(frozenset([0] + [a + 1 for a in s.vary]) if s.vary else frozenset()))
    return carry_out + ys


def op_while(flow, eqn, ins):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    flow.eval_closed(p["cond_jaxpr"], cconsts + carry)
    outs = flow.eval_closed(p["body_jaxpr"], bconsts + carry)
    return _carry(flow, carry, outs, eqn.outvars)


def op_cond(flow, eqn, ins):
    branches = eqn.params["branches"]
    results = [flow.eval_closed(b, ins[1:]) for b in branches]
    outs = []
    for i, v in enumerate(eqn.outvars):
        states = [r[i] for r in results]
        if all(s == states[0] for s in states):
            outs.append(states[0])
            continue
        splits = [s for s in states if isinstance(s, Split)]
        if splits:
            flow.conflict(frozenset().union(*(s.origins for s in splits)),
                          "the branches of a cond place it differently")
        outs.append(Rep(all_axes(len(shape_of(v)))))
    return outs


RULES = {
    "cond": op_cond,
    "scan": op_scan,
    "while": op_while,
}
