"""A running fingerprint of the examples a stream has given, so that a resume can tell whether
the stream it skips through is the one the interrupted run trained on.

Each example is fed by content: mappings by sorted key, sequences in order, arrays by dtype,
shape and bytes, numbers and strings by value. Objects of other kinds are fed by type name
only (their repr may hold a memory address, which would differ in every run).
"""

import hashlib
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

_PLAIN = (str, bytes, int, float, bool, type(None))
MARKS_KEPT = 4096  # positions remembered (a save may lag the reading by the prefetched updates)


def _feed(h, x):
    if isinstance(x, _PLAIN):
        h.update(f"{type(x).__name__}:{x!r};".encode())
    elif isinstance(x, Mapping):
        h.update(b"{")
        for k in sorted(x, key=str):
            _feed(h, str(k))
            _feed(h, x[k])
        h.update(b"}")
    elif isinstance(x, (list, tuple)):
        h.update(b"[")
        for v in x:
            _feed(h, v)
        h.update(b"]")
    elif isinstance(x, np.generic) or hasattr(x, "__array__"):
        a = np.asarray(x)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    else:
        h.update(f"<{type(x).__qualname__}>".encode())


class RunningFingerprint:
    """The fingerprint of the first n examples fed, for the last ``MARKS_KEPT`` marked n."""

    def __init__(self):
        self._hash = hashlib.blake2b(digest_size=16)
        self.count = 0
        self._marks = OrderedDict({0: self._hash.hexdigest()})

    def feed(self, example):
        _feed(self._hash, example)
        self.count += 1

    def mark(self):
        """Remember the fingerprint of the examples fed so far."""
        self._marks[self.count] = self._hash.hexdigest()
        while len(self._marks) > MARKS_KEPT:
            self._marks.popitem(last=False)

    def at(self, n):
        """The fingerprint of the first ``n`` examples, if marked (else None)."""
        return self._marks.get(n)
