"""Writing safetensors files one tensor at a time, so host memory stays near the largest tensor.

The safetensors format is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte range) and the raw bytes. The header needs only shapes and dtypes, so it is
written first and each tensor is then fetched (gathered from its shards), written and dropped
before the next. Every process calls :func:`write_safetensors` (a fetch may be a collective
gather); process 0 writes, under a temporary name renamed when complete. Dtypes are kept (bf16
stays bf16). ``path`` may be a local path or a URL ``etils.epath`` opens (``gs://...``).
"""

import collections
import json
import math
import os
import struct

import jax
import ml_dtypes
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from ..errors import ConfigError
from .workdir import is_url

_CODES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
          np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int64): "I64",
          np.dtype(np.int32): "I32", np.dtype(np.int16): "I16", np.dtype(np.int8): "I8",
          np.dtype(np.uint64): "U64", np.dtype(np.uint32): "U32", np.dtype(np.uint16): "U16",
          np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL",
          np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2"}


Deferred = collections.namedtuple("Deferred", "shape dtype fetch")
Deferred.__doc__ = "A tensor fetched only when written: ``fetch()`` gives it as a numpy array."


def entry(name, value):
    """``(name, shape, dtype, fetch)`` for an array (of any placement) or a :class:`Deferred`."""
    if isinstance(value, Deferred):
        return name, tuple(value.shape), np.dtype(value.dtype), value.fetch
    dtype = np.dtype(value.dtype) if hasattr(value, "dtype") else np.asarray(value).dtype
    return name, tuple(np.shape(value)), dtype, lambda: host_array(value)


def host_array(value):
    """One tensor on this host, whole: gathered from every process if it is split across them
    (every process must call this together for such a tensor)."""
    if not isinstance(value, jax.Array):
        return np.asarray(value)
    if not value.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    # Assembled from the shards rather than np.asarray(value), which would keep the host copy
    # cached on the array: an export would then end holding the whole model in host memory.
    out = np.empty(value.shape, value.dtype)
    for shard in value.addressable_shards:
        if shard.replica_id == 0:
            out[shard.index] = np.asarray(shard.data)
    return out


def host_row(value, row):
    """``value[row]`` on this host, whole, copying only that row's part of each shard (a layer
    of a stack of layers); every process must call this together for a tensor split across
    them."""
    if not isinstance(value, jax.Array):
        return np.asarray(value[row])
    if not value.is_fully_addressable:
        return host_array(value)[row]
    out = np.empty(value.shape[1:], value.dtype)
    for shard in value.addressable_shards:
        rows = range(value.shape[0])[shard.index[0]] if shard.index else range(value.shape[0])
        if shard.replica_id == 0 and row in rows:
            out[tuple(shard.index[1:])] = np.asarray(shard.data[row - rows.start])
    return out


def header_bytes(entries, metadata=None):
    """The header of a file holding ``entries`` [(name, shape, dtype, fetch)] in that order."""
    header, offset = {}, 0
    for name, shape, dtype, _ in entries:
        dtype = np.dtype(dtype)
        if name in header or name == "__metadata__":
            raise ConfigError(f"two tensors would be named {name!r} in one safetensors file, "
                              "which could not be read back. Fix: give each tensor its own name.")
        if dtype not in _CODES:
            raise TypeError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store.")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _CODES[dtype], "shape": [int(d) for d in shape],
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    data = json.dumps(header, separators=(",", ":")).encode()
    return data + b" " * (-len(data) % 8)  # the data starts 8-byte aligned


def write_safetensors(path, entries, metadata=None):
    """Write ``entries`` [(name, shape, dtype, fetch)], where ``fetch()`` gives the tensor as a
    numpy array of that shape and dtype, to ``path``; returns the bytes of tensor data."""
    path = os.fspath(path)
    if not is_url(path) and os.path.isdir(path):
        raise ConfigError(f"{path} is a directory; a safetensors export is one file. Fix: pass a "
                          f"file path, e.g. {os.path.join(path, 'model.safetensors')}.")
    header = header_bytes(entries, metadata)
    writing = jax.process_index() == 0
    total = 0
    tmp = f"{path}.tmp-{os.getpid()}"
    f = None
    done = False
    try:
        if writing:
            parent = epath.Path(path).parent if is_url(path) else os.path.dirname(os.path.abspath(path))
            epath.Path(parent).mkdir(parents=True, exist_ok=True)
            f = epath.Path(tmp).open("wb") if is_url(path) else open(tmp, "wb")
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
        for name, shape, dtype, fetch in entries:
            array = np.asarray(fetch())
            if not array.flags.c_contiguous:  # (np.ascontiguousarray would make 0-d arrays 1-d)
                array = array.copy(order="C")
            if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
                raise ValueError(f"tensor {name!r} came out as {array.shape} {array.dtype}, not "
                                 f"{tuple(shape)} {np.dtype(dtype)}.")
            if writing:
                f.write(memoryview(array.reshape(-1).view(np.uint8)))
            total += array.nbytes
            del array  # one tensor at a time
        if writing:
            f.close()
            f = None
            if is_url(path):
                epath.Path(tmp).rename(path)
            else:
                os.replace(tmp, path)
        done = True
    finally:
        if f is not None:
            f.close()
        if writing and not done:  # never leave a partial file beside the target
            epath.Path(tmp).unlink(missing_ok=True)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"redcoast.write_safetensors:{path}")
    return total
