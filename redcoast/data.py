"""Examples -> per-process collated rows -> global ``jax.Array`` batches sharded over 'dp'.

Each process collates only the rows of the global batch that its own devices hold, and the
global array is assembled with ``jax.make_array_from_process_local_data``. The next batch is
prepared in a background thread while the devices compute. A stream (an iterable without a
length) is read in order by every process, an update at a time (:class:`Stream`).
"""

import inspect
import itertools
import operator
import queue
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .errors import ConfigError, DataError
from .sharding.axes import DATA_AXIS
from .sharding.paths import key_to_str, path_to_str
from .store.stream_fingerprint import RunningFingerprint


def global_batch_size(per_device_batch_size, mesh):
    """Examples in one (micro-)batch on ``mesh``: ``per_device_batch_size`` per data shard. The one
    place this number is computed."""
    return per_device_batch_size * mesh.shape[DATA_AXIS]


def epoch_order(n_examples, seed, epoch, shuffle=True):
    """The order in which an epoch visits the examples: a permutation from (seed, epoch) only,
    never from the batch size or the devices, so a run resumed with another batch size goes on
    at the first example of this order that the interrupted run had not trained."""
    if not shuffle:
        return np.arange(n_examples)
    return np.random.default_rng([seed, epoch]).permutation(n_examples)


def process_rows(mesh, global_rows):
    """``(start, stop)``: the rows of a ``global_rows`` batch held by this process's devices."""
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    indices = sharding.addressable_devices_indices_map((global_rows,)).values()
    slices = sorted({s[0].indices(global_rows)[:2] for s in indices if s is not None})
    start, stop = slices[0][0], slices[0][1]
    for s, e in slices[1:]:
        if s > stop:
            raise DataError(
                "This process's devices hold non-contiguous rows of the batch, which redcoast does "
                "not support. Fix: build the mesh with jax.make_mesh so each process's devices are "
                "adjacent along the 'dp' axis.")
        stop = max(stop, e)
    return start, stop


def is_sequence(examples):
    """Indexable with a length (a list, a sequence, a ``datasets.Dataset``): shuffled by epoch."""
    return hasattr(examples, "__len__") and hasattr(examples, "__getitem__")


def is_iterator(examples):
    """A one-shot iterator (a generator object, ``map(...)``, an open file): readable once."""
    return hasattr(examples, "__next__") and iter(examples) is examples


def is_endless(iterable):
    """True for the iterators known never to end (``itertools.count``, ``cycle``, ``repeat``
    without ``times``); any other stream may or may not end, which cannot be told in advance."""
    if isinstance(iterable, (itertools.count, itertools.cycle)):
        return True
    return isinstance(iterable, itertools.repeat) and operator.length_hint(iterable, -1) < 0


class Stream:
    """One epoch's examples read in order from an iterable, an update at a time, never all held.

    ``peek(n)`` reads the first ``n`` ahead (kept, not lost); ``skip(n)`` drops the first ``n``
    without collating them (a resume's fast-forward); ``updates(per_update)`` yields lists of
    ``per_update`` examples until the iterable ends, leaving the last incomplete group's size in
    ``leftover`` (those examples are not trained on, as the last incomplete batch of a sequence).
    ``fingerprint(n)``: of the first ``n`` examples given or skipped, at the end of a skip or an
    update (stream_fingerprint.py), for a checkpoint to record and a resume to compare.
    """

    def __init__(self, iterable):
        self.endless = is_endless(iterable)
        self._iterator = iter(iterable)
        self._head = []  # read by peek, not handed out yet
        self.leftover = 0
        self._given = RunningFingerprint()

    def _next(self):
        example = self._head.pop(0) if self._head else next(self._iterator)
        self._given.feed(example)
        return example

    def fingerprint(self, n):
        return self._given.at(n)

    def peek(self, n):
        while len(self._head) < n:
            try:
                self._head.append(next(self._iterator))
            except StopIteration:
                break
        return self._head[:n]

    def skip(self, n):
        """Drop the next ``n`` examples; returns how many there were (fewer if the stream ended)."""
        for dropped in range(n):
            try:
                self._next()
            except StopIteration:
                self._given.mark()
                return dropped
        self._given.mark()
        return n

    def updates(self, per_update):
        while True:
            group: list = []
            try:
                while len(group) < per_update:
                    group.append(self._next())
            except StopIteration:
                self.leftover = len(group)
                return
            self._given.mark()
            yield group


class EpochData:
    """One epoch's training examples in the order they are trained, handed out an update at a
    time as ``(examples, indices)`` for :meth:`BatchMaker.make`: a sequence through its epoch
    order (:func:`epoch_order`; nothing is read ahead), any other iterable as a :class:`Stream`
    in the order it gives them. ``length`` is None for a stream (known once it has ended);
    ``leftover``: the examples at the end that did not fill an update (not trained on)."""

    def __init__(self, examples, seed: int, epoch: int, shuffle: bool = True):
        self.length: int | None = None
        self.stream: Stream | None = None
        self.examples: Any = None  # a sequence's
        self.order = np.arange(0)  # a sequence's
        if is_sequence(examples):
            self.examples, self.length = examples, len(examples)
            self.order = epoch_order(len(examples), seed, epoch, shuffle)
        else:
            self.stream = examples if isinstance(examples, Stream) else Stream(examples)
        self._start = 0  # of a sequence: the first example of its order not handed out yet
        self.leftover = 0

    @property
    def endless(self):
        return self.stream is not None and self.stream.endless

    def first(self, n):
        """The epoch's first ``n`` examples (fewer if a stream holds fewer), read ahead and
        kept: ``(examples, indices)``."""
        if self.stream is None:
            return self.examples, self.order[:n]
        head = self.stream.peek(n)
        return head, np.arange(len(head))

    def first_batch(self, collate_fn, per_device_batch_size, mesh, accumulate_grad_batches=1):
        """The epoch's first micro-batch on ``mesh`` (for tracing and measuring the step),
        where the epoch holds one update (a stream: one micro-batch), else a ConfigError."""
        global_batch = global_batch_size(per_device_batch_size, mesh)
        examples, indices = self.first(global_batch)
        if self.length is not None:
            updates_per_epoch(self.length, per_device_batch_size, mesh.shape[DATA_AXIS],
                              accumulate_grad_batches)
        elif len(indices) < global_batch:
            raise ConfigError(
                f"train_examples ended after {len(indices)} examples, fewer than one batch of "
                f"{global_batch} (per_device_batch_size={per_device_batch_size} x "
                f"{mesh.shape[DATA_AXIS]} data shards). Fix: use a smaller batch size.")
        return BatchMaker(mesh, collate_fn, global_batch).make(examples, indices)

    def skip_trained(self, n, per_update, epoch, fingerprint=None):
        """Pass over the ``n`` examples of epoch ``epoch`` trained before a checkpoint (a stream's
        must have ``fingerprint`` where given); the updates of ``per_update`` left (None for a
        stream). Examples that are not those the checkpoint's run trained are a DataError."""
        if self.stream is None:
            left = updates_after(len(self.order), n, per_update, epoch)
            self._start = n
            return left
        skipped = self.stream.skip(n)
        if skipped == n and fingerprint is not None and self.fingerprint(n) != fingerprint:
            raise DataError(
                f"train_examples gives other examples than the interrupted run read: the first "
                f"{n} examples of epoch {epoch + 1}, which the checkpoint says were trained on, "
                "are not those (their fingerprint differs), so skipping them would leave "
                "examples untrained and train others twice. Fix: give the same examples in the "
                "same order on resume (a function of the epoch or a re-iterable that starts the "
                "epoch afresh), or resume=False to start afresh.")
        if skipped < n:
            raise DataError(
                f"train_examples ended after {skipped} examples of epoch {epoch + 1}, but {n} of "
                "them were trained on before the resumed checkpoint: it is not the stream the "
                "interrupted run read. Fix: give the same examples in the same order on resume "
                "(a function of the epoch or a re-iterable that starts the epoch afresh), or "
                "resume=False.")
        return None

    def fingerprint(self, n):
        """Of a stream's first ``n`` examples given or skipped (None for a sequence, whose
        examples are fixed by their order)."""
        return None if self.stream is None or not n else self.stream.fingerprint(n)

    def updates(self, per_update):
        """``(examples, indices)`` of each full update of ``per_update`` examples, in order."""
        if self.stream is not None:
            rows = np.arange(per_update)
            for group in self.stream.updates(per_update):
                yield group, rows
            self.leftover = self.stream.leftover
            return
        n_updates, self.leftover = divmod(len(self.order) - self._start, per_update)
        for start in self._start + per_update * np.arange(n_updates):
            yield self.examples, self.order[start:start + per_update]


def updates_per_epoch(n_examples, per_device_batch_size, n_data_shards, accumulate_grad_batches):
    """Updates in an epoch of ``n_examples`` (the last incomplete one left out); at least one."""
    per_update = per_device_batch_size * n_data_shards * accumulate_grad_batches
    if n_examples < per_update:
        raise ConfigError(
            f"{n_examples} training examples do not fill one update of {per_update} "
            f"(per_device_batch_size={per_device_batch_size} x {n_data_shards} data shards x "
            f"accumulate_grad_batches={accumulate_grad_batches}). Fix: use a smaller batch size.")
    return n_examples // per_update


def updates_after(n_examples, trained, per_update, epoch):
    """Updates of ``per_update`` left in epoch ``epoch`` of ``n_examples`` once ``trained`` of
    them (before a resumed checkpoint) are."""
    if trained > n_examples:
        raise DataError(
            f"epoch {epoch + 1} has {n_examples} training examples, but {trained} of them were "
            "trained on before the resumed checkpoint: these are not the examples the interrupted "
            "run trained on. Fix: give the same examples on resume, or resume=False.")
    return (n_examples - trained) // per_update


def _epoch_function(fn):
    """``fn`` as a function of the epoch: ``fn(epoch)``, or ``fn()`` when it takes no argument
    (redco's ``fn(epoch_idx=...)`` is adapted in ``redcoast.compat``)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): called with the epoch
        return fn
    for args in ((0,), ()):
        try:
            signature.bind(*args)
        except TypeError:
            continue
        return fn if args else (lambda epoch: fn())
    raise ConfigError(
        f"train_examples is a function{signature} that cannot be called with the epoch alone "
        "(train_examples(epoch)) nor with no argument. Fix: give it one of those signatures, e.g. "
        "`lambda epoch: my_examples(epoch)`.")


def _sequence_or_stream(examples):
    return examples if is_sequence(examples) else Stream(examples)


def examples_by_epoch(train_examples):
    """``epoch -> that epoch's examples``: a sequence (shuffled by epoch), or a :class:`Stream`
    read in order. ``train_examples`` may be

    - a sequence: the same examples every epoch;
    - a function of the epoch (called with the epoch, or with no argument when it takes none),
      called once per epoch, returning a sequence or any iterable;
    - a re-iterable without a length (a ``datasets.IterableDataset``, an object with ``__iter__``):
      iterated afresh each epoch (``set_epoch(epoch)`` called first where it has one, so its own
      shuffling follows the epoch);
    - a one-shot iterator (a generator object): read once, so for one epoch only.
    """
    if callable(train_examples) and not hasattr(train_examples, "__getitem__"):
        make = _epoch_function(train_examples)
        return _cached_by_epoch(lambda epoch: _sequence_or_stream(make(epoch)))
    if is_sequence(train_examples):
        return lambda epoch: train_examples
    if is_iterator(train_examples):
        stream = Stream(train_examples)
        first: list[int] = []

        def once(epoch):
            if not first:
                first.append(epoch)
            if epoch != first[0]:
                raise DataError(
                    f"train_examples is an iterator ({type(train_examples).__name__}), read to its "
                    f"end in epoch {first[0] + 1}; it cannot be read again for epoch {epoch + 1}. "
                    "Fix: pass a function returning a fresh iterator (e.g. `lambda epoch: "
                    "my_generator(epoch)`), a re-iterable (a list, a datasets.IterableDataset), "
                    "or n_epochs=1.")
            return stream
        return once

    def fresh(epoch):
        if hasattr(train_examples, "set_epoch"):
            train_examples.set_epoch(epoch)
        return Stream(train_examples)
    return _cached_by_epoch(fresh)


def _cached_by_epoch(make):
    """``make(epoch)`` called once per epoch (the last epoch's result kept)."""
    cache: dict = {}

    def of_epoch(epoch):
        if epoch not in cache:
            cache.clear()
            cache[epoch] = make(epoch)
        return cache[epoch]
    return of_epoch


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
        spec = P(DATA_AXIS) if micro_batches == 1 else P(None, DATA_AXIS)
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
            NamedSharding(self.mesh, P(DATA_AXIS)), rows, (self.global_batch_size,))


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
    q: queue.Queue = queue.Queue(maxsize=size)
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
