"""FSDP-split weights that the step should not gather: the activations they read are smaller.

With model shards, the training step all-gathers each weight FSDP stores split over 'dp' where
the loss starts (layout/steps.py ``gathered``), and reduces its gradient over 'dp': it moves the
weight's model-shard share. Left unconstrained, XLA's partitioner can instead keep the weight
where it is stored and gather the activation its matmul reads over 'dp' (every data shard's
rows, the weight's contracted features): it moves the activation. Which is smaller depends on
the weight's output columns a model shard against the global batch's rows, so it differs per
weight: at the 1B width (hidden 2048, MLP 5632, vocabulary 32000) on 4 x 2 with 1024 tokens a
step, Q/K/V's 1024 columns a shard tie with the rows and the rest are larger, while at 4096
tokens only the 16000-column head is.

Measured on XLA:CPU (8 simulated devices, the 1B width at 2 layers, bf16 compute): at 1024
tokens on 4 x 2 the step takes 7.7 s with only the weights below gathered, against 10.3 s
gathering all and 10.3 s gathering none (the peak 817 MiB against 1150 and 831); on 2 x 4,
6.9 s against 7.3 (651 against 740 MiB); at 4096 tokens on 4 x 2, 27.2 s against 28.1 (the
same peak), and SmolLM2's 30 layers at 1024 tokens (every weight below) unchanged. Gathering
none at all was 1.5x the step on a small Llama whose activations are larger than its weights
(benchmarks/defaults_vs_hand.py's 4 x 2): there every weight is below.

A weight is left to the partitioner only when every read of it is a matmul (through calls and
views); a weight read otherwise (a lookup, a norm's scale, a loop's or remat's input) is
gathered as before.
"""

import numpy as np

from . import weight_origins


def _pieces(origin, var_axes, model_shards):
    """Into how many pieces the plan splits ``var_axes`` of a view of a weight (``origin``) over
    the model shards: all of them, a group's count (grouped_axes.py), or 1."""
    for d in var_axes:
        groups = None if origin.axes[d] is None else origin.weight.groups(origin.axes[d])
        if groups is not None:
            return groups[0] or model_shards
    return 1


def _shard_elements(origin, shape, model_shards):
    """Elements of a weight operand of ``shape`` on one model shard."""
    return int(np.prod(shape, dtype=np.int64)) // _pieces(origin, range(len(shape)), model_shards)


def _gathered_activation(eqn, side, origin, model_shards):
    """Elements of the other operand of matmul ``eqn`` (the weight on ``side``) gathered over
    'dp': its rows (the traced batch is global) times its contracted features a model shard (a
    row-parallel weight reads its shard's)."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    w_contract, x_contract = (lc, rc) if side == 0 else (rc, lc)
    x = eqn.invars[1 - side].aval
    contracted = int(np.prod([x.shape[d] for d in x_contract], dtype=np.int64))
    rows = int(np.prod(x.shape, dtype=np.int64)) // max(1, contracted)
    return rows * contracted // _pieces(origin, w_contract, model_shards)


def left_to_partitioner(closed, weights, model_shards):
    """The indices of the parameter leaves (the first ``len(weights)`` inputs of ``closed``, the
    loss's ClosedJaxpr; ``weights``: their rewrite_plan.WeightSplits) read only by matmuls whose
    activations, gathered over 'dp', are smaller than the weight's model-shard share."""
    weight_elements, activation, elsewhere = {}, {}, set()

    def use(eqn, read):
        if eqn.primitive.name != "dot_general" or len(read) != 1:
            elsewhere.update(read)
            return
        (i, (side, origin)), = read.items()
        shape = eqn.invars[side].aval.shape
        weight_elements[i] = max(weight_elements.get(i, 0),
                                 _shard_elements(origin, shape, model_shards))
        activation[i] = activation.get(i, 0) + _gathered_activation(eqn, side, origin, model_shards)

    weight_origins.visit_reads(closed, weights, use)
    return {i for i, n in weight_elements.items() if i not in elsewhere and n > activation[i]}
