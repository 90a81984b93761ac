"""Examples -> per-process collated rows -> global ``jax.Array`` batches sharded over 'dp'.

Each process collates only the rows of the global batch that its own devices hold, and the
global array is assembled with ``jax.make_array_from_process_local_data``. The next batch is
prepared in a background thread while the devices compute.
"""

import queue
import threading
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .errors import DataError
from .sharding.paths import key_to_str, path_to_str


def epoch_order(n_examples, seed, epoch, shuffle=True):
    """The order in which an epoch visits the examples: a permutation from (seed, epoch) only."""
    if not shuffle:
        return np.arange(n_examples)
    return np.random.default_rng([seed, epoch]).permutation(n_examples)


def process_rows(mesh, global_rows):
    """``(start, stop)``: the rows of a ``global_rows`` batch held by this process's devices."""
    sharding = NamedSharding(mesh, P("dp"))
    slices = sorted({(s[0].indices(global_rows)[:2]) for s in
                     sharding.addressable_devices_indices_map((global_rows,)).values()})
    start, stop = slices[0][0], slices[0][1]
    for s, e in slices[1:]:
        if s > stop:
            raise DataError(
                "This process's devices hold non-contiguous rows of the batch, which redcoast does "
                "not support. Fix: build the mesh with jax.make_mesh so each process's devices are "
                "adjacent along the 'dp' axis.")
        stop = max(stop, e)
    return start, stop


def as_examples(examples):
    """``examples`` indexable with a length: a list, a sequence, a ``datasets.Dataset``; any other
    iterable (a generator, an iterable dataset) is read into a list once."""
    if hasattr(examples, "__len__") and hasattr(examples, "__getitem__"):
        return examples
    return list(examples)


def examples_by_epoch(train_examples):
    """``epoch -> that epoch's examples``. ``train_examples`` may be a function of the epoch
    (called as ``train_examples(epoch_idx=epoch)`` when it names that argument, as redco did, else
    with the epoch), called once per epoch, or examples for every epoch."""
    if callable(train_examples) and not hasattr(train_examples, "__getitem__"):
        from .compat.calls import by_keyword  # redco's calling convention, kept apart
        make = by_keyword(train_examples, ("epoch_idx",))
        cache = {}

        def of_epoch(epoch):
            if epoch not in cache:
                cache.clear()
                cache[epoch] = as_examples(make(epoch))
            return cache[epoch]
        return of_epoch
    examples = as_examples(train_examples)
    return lambda epoch: examples


def take(examples, indices):
    """``examples[i]`` for each index: works for lists, sequences and ``datasets.Dataset``."""
    return [examples[int(i)] for i in indices]


def _plain_dicts(tree):
    """Mappings (a tokenizer's ``BatchEncoding``, a FrozenDict) as plain dicts, recursively."""
    if isinstance(tree, Mapping):
        return {k: _plain_dicts(v) for k, v in tree.items()}
    return tree


def check_collated(batch, n_rows, where="collate_fn"):
    """Turn ``collate_fn``'s output into a dict of numpy arrays with ``n_rows`` rows, or explain."""
    batch = _plain_dicts(batch)
    if not isinstance(batch, dict):
        raise DataError(
            f"{where} returned a {type(batch).__name__}; redcoast needs a dict of arrays with the "
            f"batch first, e.g. {{'input_ids': array of shape ({n_rows}, seq_len)}}. "
            f"Fix: return a dict from {where}.")
    is_array = lambda x: not isinstance(x, dict)  # lists of rows are arrays, not subtrees
    checked = []
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch, is_leaf=is_array)
    for key_path, value in flat:
        key = path_to_str(tuple(key_to_str(k) for k in key_path))
        try:
            array = np.asarray(value)
        except ValueError as e:
            raise DataError(
                f"{where} returned a ragged value for key '{key}' (its rows have different "
                f"lengths): {e}. Fix: pad every row of '{key}' to one length in {where}.") from e
        if array.dtype.kind in "OUSVM":
            kind = "ragged or mixed-type rows" if array.dtype.kind == "O" else f"dtype {array.dtype}"
            raise DataError(
                f"{where} returned non-numeric data for key '{key}' ({kind}). Fix: tokenize or "
                f"encode '{key}' into numbers and pad it to a fixed length in {where}, or leave it "
                "out of the batch.")
        if array.ndim == 0 or array.shape[0] != n_rows:
            got = "a scalar" if array.ndim == 0 else f"{array.shape[0]} rows (shape {array.shape})"
            raise DataError(
                f"{where} was given {n_rows} examples but returned {got} for key '{key}'. Fix: "
                f"every array returned by {where} must have the batch dimension first, one row "
                "per example.")
        checked.append(array)
    return jax.tree_util.tree_unflatten(treedef, checked)


class BatchMaker:
    """Builds the global batches of one loop (train, eval or predict) on a mesh.

    ``micro_batches`` > 1 gives every array a leading micro-batch axis (for gradient
    accumulation inside one jitted step).
    """

    def __init__(self, mesh, collate_fn, global_batch_size, micro_batches=1):
        self.mesh = mesh
        self.collate_fn = collate_fn
        self.global_batch_size = global_batch_size
        self.micro_batches = micro_batches
        self.row_start, self.row_stop = process_rows(mesh, global_batch_size)
        spec = P("dp") if micro_batches == 1 else P(None, "dp")
        self.sharding = NamedSharding(mesh, spec)

    def local_indices(self, indices):
        """This process's share of a global step's example indices, micro-batch by micro-batch."""
        g = self.global_batch_size
        return np.concatenate([indices[j * g + self.row_start: j * g + self.row_stop]
                               for j in range(self.micro_batches)])

    def make(self, examples, indices):
        """The global batch for ``indices`` (``global_batch_size * micro_batches`` of them)."""
        local = self.local_indices(indices)
        batch = check_collated(self.collate_fn(take(examples, local)), len(local))
        return self.to_global(batch)

    def to_global(self, local_batch):
        rows = self.row_stop - self.row_start
        k = self.micro_batches

        def place(x):
            if k > 1:
                x = x.reshape((k, rows) + x.shape[1:])
            lead = (self.global_batch_size,) if k == 1 else (k, self.global_batch_size)
            global_shape = lead + x.shape[len(lead):]
            return jax.make_array_from_process_local_data(self.sharding, x, global_shape)

        return jax.tree_util.tree_map(place, local_batch)

    def padding_mask(self, n_real):
        """A global boolean array marking the real rows of a padded last batch."""
        rows = np.arange(self.row_start, self.row_stop) < n_real
        return jax.make_array_from_process_local_data(
            NamedSharding(self.mesh, P("dp")), rows, (self.global_batch_size,))


def padded_batches(n_examples, global_batch_size):
    """Index arrays covering ``range(n_examples)`` in order; the last is padded by repeating the
    last example, and the number of real rows is returned with each."""
    for start in range(0, n_examples, global_batch_size):
        idx = np.arange(start, min(start + global_batch_size, n_examples))
        n_real = len(idx)
        if n_real < global_batch_size:
            idx = np.concatenate([idx, np.full(global_batch_size - n_real, idx[-1])])
        yield idx, n_real


def prefetch(iterable, size=2):
    """Run ``iterable`` in a background thread, ``size`` items ahead; errors surface in order."""
    q = queue.Queue(maxsize=size)
    done = object()
    stop = threading.Event()

    def worker():
        try:
            for item in iterable:
                if stop.is_set():
                    return
                q.put((True, item))
            q.put((True, done))
        except BaseException as e:  # handed to the consumer, raised there
            q.put((False, e))

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                raise item
            if item is done:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.05)
