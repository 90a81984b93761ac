"""Sequence packing: several tokenised sequences per fixed-length row, for causal-LM training.

Padding every sequence to the longest wastes the compute of the padding; packing fills each row
with whole sequences instead (first fit, longest first), and marks which tokens belong together
so that nothing crosses a sequence's boundary:

- ``segment_ids``: 1, 2, ... per sequence in the row, 0 for padding. A model that takes them
  (``redcoast.models`` Llama: ``model.apply(params, input_ids, segment_ids=...)``) attends
  within each segment only;
- ``positions``: counted from 0 at each sequence's first token;
- ``targets`` and ``loss_mask``: the next token of the same sequence, weighted by the sequence's
  own ``loss_mask`` for that token (e.g. 1 on an assistant's tokens only); the last token of a
  sequence predicts nothing.

A row's loss summed over its tokens is then the sum of its sequences' losses computed alone, so
the mean over the mask's tokens is the same number as on padded rows.
"""

import numpy as np

from ..errors import DataError


def pack_sequences(sequences, seq_len, pad_id=0):
    """Rows of ``seq_len`` tokens: each a dict of int32 ``input_ids``, ``targets``,
    ``segment_ids``, ``positions`` and float32 ``loss_mask`` (numpy, ``[seq_len]``).

    ``sequences``: token id lists, or dicts with ``input_ids`` and optionally ``loss_mask`` (one
    0/1 per token: whether that token is to be predicted; default all 1). Whole sequences are
    placed, longest first, each into the first row with room (ties in the given order, so the
    result depends only on the input). A sequence longer than ``seq_len`` is an error: cut it
    first, or raise ``seq_len``.
    """
    items = _items(sequences, seq_len)
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
    rows, room = [], []  # rows: lists of sequence indices; room: free tokens left in each
    for i in order:
        n = len(items[i][0])
        if n == 0:
            continue
        row = next((r for r, free in enumerate(room) if free >= n), None)
        if row is None:
            rows.append([])
            room.append(seq_len)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= n
    return [_row([items[i] for i in sorted(members)], seq_len, pad_id) for members in rows]


def pad_sequences(sequences, seq_len, pad_id=0):
    """One sequence per row, padded to ``seq_len``: the rows :func:`pack_sequences` would give
    with no packing (same fields, the sequence as segment 1), in the given order; for a padded
    baseline, or for evaluating one sequence per row."""
    return [_row([item], seq_len, pad_id) for item in _items(sequences, seq_len)]


def packed_fraction(rows):
    """The fraction of the rows' tokens that are real (not padding)."""
    if not rows:
        return 0.0
    return float(np.mean([np.mean(r["segment_ids"] != 0) for r in rows]))


def _items(sequences, seq_len):
    items = [_as_item(s, i) for i, s in enumerate(sequences)]
    for i, (ids, _) in enumerate(items):
        if len(ids) > seq_len:
            raise DataError(f"sequence {i} has {len(ids)} tokens, more than seq_len={seq_len}: "
                            "a row holds whole sequences. Fix: truncate it first or use longer "
                            "rows.")
    return items


def _as_item(sequence, index):
    if isinstance(sequence, dict):
        ids = list(sequence["input_ids"])
        mask = list(sequence.get("loss_mask", [1] * len(ids)))
    else:
        ids, mask = list(sequence), [1] * len(sequence)
    if len(mask) != len(ids):
        raise DataError(f"sequence {index}: loss_mask has {len(mask)} entries for {len(ids)} "
                        "tokens. Fix: one 0/1 per token.")
    return ids, mask


def _row(members, seq_len, pad_id):
    input_ids = np.full(seq_len, pad_id, np.int32)
    targets = np.full(seq_len, pad_id, np.int32)
    segment_ids = np.zeros(seq_len, np.int32)
    positions = np.zeros(seq_len, np.int32)
    loss_mask = np.zeros(seq_len, np.float32)
    start = 0
    for segment, (ids, mask) in enumerate(members, start=1):
        n = len(ids)
        span = slice(start, start + n)
        input_ids[span] = ids
        segment_ids[span] = segment
        positions[span] = np.arange(n)
        # token t predicts token t + 1 of the same sequence, weighted by that token's mask
        targets[start:start + n - 1] = ids[1:]
        loss_mask[start:start + n - 1] = mask[1:]
        start += n
    return {"input_ids": input_ids, "targets": targets, "segment_ids": segment_ids,
            "positions": positions, "loss_mask": loss_mask}
