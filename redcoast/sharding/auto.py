"""Automatic tensor-parallel placement from the params alone (shapes and written order).

This is the first, structural version of the paper's two rules: consecutive dense layers
alternate column (split outputs) and row (split inputs) splits, attention splits Q, K, V by
output and O by input. It reads the model width from the shapes, so it needs no layer names
except to recognise embeddings. Whatever does not divide is replicated, and the plan says why.
"""

from collections import Counter

import numpy as np
from jax.sharding import PartitionSpec as P

from .axes import MODEL_AXIS
from .paths import leaves_in_written_order
from .rules import Placement

EMBEDDING_NAMES = ("embed", "wte", "wpe", "embedding")
KERNEL_NAMES = ("kernel", "weight", "w")
BIAS_NAMES = ("bias", "b")


def _is_bias(path):
    return bool(path) and path[-1].lower() in BIAS_NAMES


def model_width(shapes):
    """The residual-stream width: the dimension found in the most parameter bytes.

    Every large matrix of a transformer touches the residual stream, so its width is the
    dimension shared by most of the parameters by size (head counts and head sizes are not).
    """
    weight = Counter()
    for s in shapes:
        if len(s) >= 2:
            for d in set(s):
                weight[d] += int(np.prod(s))
    if not weight:
        return None
    return max(weight, key=lambda d: (weight[d], d))


def _split(shape, axis, n, what):
    """Spec splitting ``axis`` over 'mp', or replicated with the reason if it does not divide."""
    if n == 1:
        return P(), "replicated (one model shard)"
    if shape[axis] % n:
        return P(), f"replicated: {what} dimension {shape[axis]} is not divisible by {n} shards"
    return P(*([None] * axis + [MODEL_AXIS])), f"{what} split over {n} shards"


def _is_embedding(path, shape):
    name = path[-1].lower() if path else ""
    parent = path[-2].lower() if len(path) > 1 else ""
    return len(shape) == 2 and any(e in name or e in parent for e in EMBEDDING_NAMES)


def _block_of(path):
    """The module that holds a dense layer: a kernel's grandparent, other leaves' parent."""
    return path[:-2] if len(path) >= 2 and path[-1].lower() in KERNEL_NAMES else path[:-1]


def auto_placements(params, n_model_shards):
    """One :class:`Placement` per leaf of ``params`` (leaves in written order)."""
    leaves = [(path, tuple(np.shape(leaf)), getattr(leaf, "dtype", np.float32))
              for path, leaf in leaves_in_written_order(params)]
    hidden = model_width([s for _, s, _ in leaves])
    n = n_model_shards
    decided = {}

    # Square (hidden x hidden) kernels are ambiguous by shape; their order settles it: in a run of
    # them inside one block (Q, K, V, O) all but the last read the residual stream (column), the
    # last writes it back (row).
    square_runs, run, last_block = [], [], None
    for path, shape, _ in leaves:
        if len(shape) < 2 or _is_bias(path):
            continue  # biases and norms sit between kernels but do not break a run
        is_square = len(shape) == 2 and shape[0] == shape[1] == hidden and not _is_embedding(path, shape)
        block = _block_of(path)
        if (not is_square or block != last_block) and run:
            square_runs.append(run)
            run = []
        if is_square:
            run.append(path)
        last_block = block
    if run:
        square_runs.append(run)
    for run in square_runs:
        for i, path in enumerate(run):
            row = i == len(run) - 1 and len(run) > 1
            decided[path] = ("row", 0) if row else ("column", 1)

    # Kernels with one hidden dimension: split the other one, whatever the layout ((in, out) for
    # Flax, (out, in) for PyTorch-style weights): that is the column split of a layer reading the
    # residual stream and the row split of one writing to it.
    placements = {}
    for path, shape, dtype in leaves:
        if len(shape) < 2 or _is_bias(path):
            continue
        if _is_embedding(path, shape):
            vocab_axis = 0 if shape[0] != hidden else 1
            spec, reason = _split(shape, vocab_axis, n, "embedding vocabulary")
            if spec == P() and n > 1:
                spec, reason = _split(shape, 1 - vocab_axis, n, "embedding hidden")
        elif path in decided:
            kind, axis = decided[path]
            spec, reason = _split(shape, axis, n, f"{kind}-parallel ({'output' if axis else 'input'} features)")
        elif len(shape) == 2:
            if hidden in shape:
                inner = 1 if shape[0] == hidden else 0
                spec, reason = _split(shape, inner, n, "inner (non-hidden)")
            else:
                spec, reason = P(), "replicated: no dimension equals the model width"
        elif len(shape) == 3 and shape[0] == hidden:  # (hidden, heads, head_dim): Q/K/V
            spec, reason = _split(shape, 1, n, "attention heads (column-parallel)")
        elif len(shape) == 3 and shape[-1] == hidden and shape[0] * shape[1] == hidden:
            # (heads, head_dim, hidden): attention output, row-parallel over heads
            spec, reason = _split(shape, 0, n, "attention heads (row-parallel)")
        elif len(shape) == 3 and hidden in shape[1:]:
            # layers stacked for scan, or experts: (n, hidden, inner) or (n, inner, hidden)
            inner = 2 if shape[1] == hidden else 1
            spec, reason = _split(shape, inner, n, "inner (non-hidden)")
        else:
            spec, reason = P(), f"replicated: no rule for a {len(shape)}-D parameter of shape {shape}"
        placements[path] = Placement(path, shape, dtype, spec, reason)

    # Vectors and the rest: biases follow their kernel's output split, norms stay replicated.
    by_block = {}
    for path, shape, _ in leaves:
        if len(shape) >= 2 and path[-1].lower() in KERNEL_NAMES:
            by_block[path[:-1]] = placements[path]
    for path, shape, dtype in leaves:
        if path in placements:
            continue
        kernel = by_block.get(path[:-1])
        spec, reason = P(), "replicated: small or not a matmul weight"
        if kernel is not None and len(shape) >= 1 and kernel.spec != P():
            k_spec = tuple(kernel.spec) + (None,) * (len(kernel.shape) - len(kernel.spec))
            if tuple(kernel.shape[-len(shape):]) == shape and any(k_spec[-len(shape):]):
                spec, reason = P(*k_spec[-len(shape):]), "bias split with its layer's outputs"
            elif tuple(kernel.shape[:len(shape)]) == shape and any(k_spec[:len(shape)]) and hidden not in shape:
                spec, reason = P(*k_spec[:len(shape)]), "bias split with its layer's outputs"
        placements[path] = Placement(path, shape, dtype, spec, reason)
    return [placements[path] for path, _, _ in leaves]
