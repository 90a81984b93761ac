"""Where each column split ends, and which splits buy nothing (issue 49, pattern 4).

A column-parallel weight is worth splitting when its split output is *used* split: it reaches a
row-parallel matmul (Megatron's pair, one all-reduce for the two), an activation contraction whose
partial sums are all-reduced (an MoE's combine over split experts), or the function's output.
Some splits only end in reductions over their own split axis: a router ``Dense(E)`` whose
logits feed a softmax, an arg-max or a gate sum over the experts. Each such reduction is a
collective of a [tokens] vector (and its gradient another), and nothing after it stays split,
so all the split buys is a slice of the weight's own small matmul. Where the weight also narrows
the stream it reads (its output axis is smaller than what it contracts: E scores from a hidden
state), replicating it costs less than those reductions: the plan keeps it whole. An LM head's
vocabulary (wider than the hidden state) stays split: Megatron's vocabulary-parallel cross
entropy reduces over it too, but replicating that weight would cost its whole size per shard.

The analysis notes each end (``note``) and each narrow column split (``column``) as it walks the
program; after a walk, ``blames`` names the splits to give up, as a conflict would.
"""

REDUCED = "reduced"  # reduced (or picked) over the split axis: replicated by a collective
KEPT = "kept"        # used split: a row-parallel matmul, a contraction all-reduced, an output


class SplitEnds:
    """The ends of the splits of one walk over the program."""

    def __init__(self):
        self.ends = {}       # leaf -> {REDUCED, KEPT}: how splits it made ended
        self.narrow = {}     # leaf -> (output size, contracted size) of a narrowing column split

    def note(self, origins, how):
        for leaf in origins:
            self.ends.setdefault(leaf, set()).add(how)

    def column(self, leaf, out_size, contracted_size):
        """``leaf`` is split on an output axis of ``out_size`` in a matmul contracting
        ``contracted_size`` elements per output: remembered when that narrows the stream."""
        if out_size < contracted_size:
            self.narrow[leaf] = (out_size, contracted_size)

    def blames(self, is_split):
        """{leaf: reason} for the narrowing column splits whose every end is a reduction."""
        out = {}
        for leaf, (size, width) in self.narrow.items():
            if is_split(leaf) and self.ends.get(leaf) == {REDUCED}:
                out[leaf] = (f"its split output ({size} wide, from {width}) is only ever reduced "
                             "over its split axis (a softmax, arg-max or gate sum over it, as a "
                             "router's over its experts): each reduction would be an all-reduce "
                             "and nothing after them stays split, so this small weight is kept "
                             "whole")
        return out
