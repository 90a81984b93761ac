"""A GGUF file's header read in one pass and checked as llama.cpp's loader checks it: its
metadata as Python values and where each tensor's bytes lie (mapped, not read).

``gguf.GGUFReader`` builds a numpy view of the mapped file for every value it parses, one per
token of a tokenizer's vocabulary and merges: SmolLM2-135M's header (49,152 tokens, 48,900
merges) took it 6.0 s here, a Llama 3 vocabulary several times that. The format (GGUF versions 2
and 3, github.com/ggml-org/ggml/blob/master/docs/gguf.md) is a flat sequence of little- or
big-endian values; this reads it with ``struct`` and keeps ``gguf``'s own tables of tensor types
and block sizes and its dequantisers. tests/test_models_gguf.py compares every value and tensor
with ``GGUFReader``'s on the packaged model and on a file of every value type.

A file from elsewhere is checked before anything is allocated or viewed, as ggml's
``gguf_init_from_file`` checks it: every count and length against the bytes left in the file,
no key or tensor name twice, known value and tensor types, at most 4 dimensions whose product
fits an int64, rows whole blocks of their type, an alignment that is a power of two, each
tensor starting where the ones before it end (padded), and every tensor's bytes inside the file.
Each defect is a :class:`~redcoast.errors.ConfigError` that names the file, the defect and where
it lies (:func:`damaged`).
"""

import dataclasses
import math
import os
import struct

import numpy as np

from ..errors import ConfigError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# ggml's limits (ggml.h): dimensions of a tensor; bytes of a tensor name, its final NUL included
MAX_DIMS = 4
MAX_NAME = 64
INT64_MAX = 2**63 - 1

# GGUF's value types: id -> struct format (scalars); 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY, _BOOL = 8, 9, 7
KIND_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32",
              6: "float32", 7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64",
              12: "float64"}
# the fewest bytes one value of a kind takes: its scalar, or a string's 8-byte length
_MIN_BYTES = {**{k: struct.calcsize(f) for k, f in _SCALARS.items()}, _STRING: 8}
# the fewest bytes of one metadata entry (key length, type, a 1-byte value) and of one tensor's
# description (name length, dimension count, type, offset)
_MIN_ENTRY, _MIN_TENSOR_INFO = 8 + 4 + 1, 8 + 4 + 4 + 8
# GGML's unquantised tensor types, viewed as numpy's (the rest are blocks of bytes)
_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}


def damaged(path, what, where):
    """The error for a defect of the GGUF file ``path``: what it is and where it lies."""
    return ConfigError(f"{path} is damaged: {what}, {where}. Fix: download or convert the "
                       "file again (an interrupted copy or a faulty converter leaves files like "
                       "this).")


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: ``shape`` lists GGUF's dimensions innermost first (as
    ``gguf.ReaderTensor.shape``), ``data`` the mapped bytes viewed as ``gguf`` views them (the
    element type for plain types, uint8 blocks for quantised ones)."""
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    """A tensor as the header describes it (``at``: the byte where its description starts)."""
    name: str
    dims: tuple
    tensor_type: object
    offset: int
    block_size: int
    type_size: int
    at: int

    @property
    def n_bytes(self):
        return math.prod(self.dims) // self.block_size * self.type_size


@dataclasses.dataclass(frozen=True)
class ValueKind:
    """How a metadata value is stored: its GGUF type (``kind``), the type of its items for an
    array, and the byte where the value starts (for messages)."""
    kind: int
    item_kind: int = None
    offset: int = 0


class _Cursor:
    """Reads values of one byte order from a buffer, advancing an offset; never past the end."""

    def __init__(self, path, buffer, order, offset):
        self.path, self.buffer, self.order, self.offset = path, buffer, order, offset
        self.size = len(buffer)
        self._structs = {}

    def need(self, n, what):
        """Fail unless ``n`` more bytes (``what``) lie in the file."""
        left = self.size - self.offset
        if n > left:
            raise self.short(n, what)

    def short(self, n, what):
        left = self.size - self.offset
        return damaged(self.path, f"{what} takes {n} bytes but the file ends {left} bytes later "
                       "(it is cut short, or a length in it is wrong)", f"at byte {self.offset}")

    def scalar(self, fmt, what):
        unpacker = self._structs.get(fmt)
        if unpacker is None:
            unpacker = self._structs[fmt] = struct.Struct(self.order + fmt)
        self.need(unpacker.size, what)
        (value,) = unpacker.unpack_from(self.buffer, self.offset)
        self.offset += unpacker.size
        return value

    def string(self, what):
        return self.strings(1, what)[0]

    def strings(self, n, what):
        """``n`` strings one after the other; ``what`` names them (item i of it, when n > 1)."""
        buffer, size, offset = self.buffer, self.size, self.offset
        length_of = struct.Struct(self.order + "Q").unpack_from
        out = []
        # the hot loop of a header (one pass per token and merge): messages built on failure only
        for i in range(n):
            if offset + 8 > size:
                self.offset = offset
                raise self.short(8, f"the length of {_item(what, i, n)}")
            (length,) = length_of(buffer, offset)
            start, offset = offset + 8, offset + 8 + length
            if offset > size:
                self.offset = start
                raise self.short(length, _item(what, i, n))
            try:
                out.append(bytes(buffer[start:offset]).decode("utf-8"))
            except UnicodeDecodeError as e:
                raise damaged(self.path, f"{_item(what, i, n)} is not UTF-8 text ({e.reason})",
                              f"at byte {start + e.start}") from None
        self.offset = offset
        return out

    def value(self, kind, what):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            return self.array(what)[1]
        raise damaged(self.path, f"{what} has value type {kind}, not one of GGUF's",
                      f"at byte {self.offset - 4}")

    def array(self, what):
        """``(item kind, list)`` of an array value; its length is checked against the bytes
        left before any item is read."""
        item_kind = self.scalar("I", f"the item type of {what}")
        if item_kind not in _MIN_BYTES:  # nor arrays of arrays, which llama.cpp refuses too
            raise damaged(self.path, f"{what} is an array of value type {item_kind}, not one "
                          "GGUF's loaders read", f"at byte {self.offset - 4}")
        n = self.scalar("Q", f"the length of {what}")
        self.need(n * _MIN_BYTES[item_kind], f"{what} ({n} items)")
        if item_kind in _SCALARS:  # numbers and bools: one view for them all
            dtype = np.dtype(self.order + _SCALARS[item_kind])
            items = np.frombuffer(self.buffer, dtype, n, self.offset)
            self.offset += n * dtype.itemsize
            return item_kind, items.tolist()
        return item_kind, self.strings(n, what)


def _item(what, i, n):
    return what if n == 1 else f"item {i} of {what}"


def read_header(path, gguf):
    """``(version, metadata, tensors)`` of the GGUF file at ``path``: ``metadata`` {key: Python
    value (lists for arrays)}, ``tensors`` {name: :class:`GGUFTensor`}. ``gguf``: the ``gguf``
    package (its tensor-type tables). A damaged file raises :class:`ConfigError`."""
    version, metadata, _, tensors = read_header_kinds(path, gguf)
    return version, metadata, tensors


def read_header_kinds(path, gguf):
    """:func:`read_header`'s values and, third, {key: :class:`ValueKind`} of the metadata."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        start = f.read(24)
    if start[:4] != MAGIC:
        raise ConfigError(f"{path} is not a GGUF file (it does not start with b'GGUF').")
    if size < 24:
        raise damaged(path, f"it is {size} bytes long, shorter than GGUF's 24-byte header",
                      "at its end")
    mapped = np.memmap(path, mode="r")
    # the header through a memoryview: slicing it costs nothing (a numpy view of a memmap is
    # what makes GGUFReader slow); the tensors below are views of the same mapping
    buffer = memoryview(mapped)
    order = "<"
    version = struct.unpack_from("<I", buffer, 4)[0]
    if version & 0xFFFF == 0:  # written on a big-endian machine
        order, version = ">", struct.unpack_from(">I", buffer, 4)[0]
    if version not in VERSIONS:
        raise ConfigError(f"{path} is GGUF version {version}; redcoast reads versions "
                          f"{VERSIONS} (convert it with a current llama.cpp).")
    cursor = _Cursor(path, buffer, order, 8)
    n_tensors = cursor.scalar("Q", "the tensor count")
    n_values = cursor.scalar("Q", "the metadata count")
    _check_count(cursor, n_values, _MIN_ENTRY, "metadata values", 16)
    metadata, kinds = _read_metadata(cursor, n_values)
    _check_count(cursor, n_tensors, _MIN_TENSOR_INFO, "tensors", 8)
    infos = _read_tensor_infos(cursor, n_tensors, gguf)
    alignment = _alignment(path, metadata, kinds)
    data_start = _pad(cursor.offset, alignment)
    return version, metadata, kinds, _place_tensors(path, mapped, order, data_start, alignment,
                                                    infos)


def _check_count(cursor, n, min_bytes, what, at):
    left = cursor.size - cursor.offset
    if n * min_bytes > left:
        raise damaged(cursor.path, f"it declares {n} {what}, but the {left} bytes left in the "
                      f"file hold at most {left // min_bytes}", f"in its header at byte {at}")


def _read_metadata(cursor, n_values):
    metadata, kinds = {}, {}
    for i in range(n_values):
        key_at = cursor.offset
        key = cursor.string(f"metadata key {i}")
        if key in metadata:  # a second value would silently replace the first
            raise damaged(cursor.path, f"the metadata key {key!r} appears twice",
                          f"the second time at byte {key_at}")
        kind = cursor.scalar("I", f"the type of metadata value {key!r}")
        value_at = cursor.offset
        if kind == _ARRAY:
            item_kind, metadata[key] = cursor.array(f"metadata value {key!r}")
        else:
            item_kind, metadata[key] = None, cursor.value(kind, f"metadata value {key!r}")
        kinds[key] = ValueKind(kind, item_kind, value_at)
    return metadata, kinds


def _read_tensor_infos(cursor, n_tensors, gguf):
    """[:class:`_TensorInfo`] of the header's tensor descriptions, each checked."""
    infos, names = [], set()
    for i in range(n_tensors):
        at = cursor.offset
        name = cursor.string(f"the name of tensor {i}")
        where = f"tensor {name!r} described at byte {at}"
        if len(name.encode()) >= MAX_NAME:
            raise damaged(cursor.path, f"a tensor name is {len(name.encode())} bytes long, "
                          f"ggml's limit is {MAX_NAME - 1}", where)
        if name in names:  # one name would hide the other tensor's bytes
            raise damaged(cursor.path, f"two tensors are named {name!r}", where)
        names.add(name)
        n_dims = cursor.scalar("I", f"the dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise damaged(cursor.path, f"tensor {name!r} has {n_dims} dimensions, ggml's "
                          f"limit is {MAX_DIMS}", where)
        dims = tuple(cursor.scalar("Q", f"a dimension of tensor {name!r}")
                     for _ in range(n_dims))
        if any(d > INT64_MAX for d in dims):
            raise damaged(cursor.path, f"tensor {name!r} has a negative dimension (as ggml "
                          f"reads them: int64) in {dims}", where)
        n_elements = math.prod(dims)
        if n_elements >= INT64_MAX:
            raise damaged(cursor.path, f"the dimensions {dims} of tensor {name!r} hold "
                          "more elements than an int64 counts", where)
        type_id = cursor.scalar("I", f"the type of tensor {name!r}")
        tensor_type = _tensor_type(gguf, type_id)
        if tensor_type is None:
            raise damaged(cursor.path, f"tensor {name!r} has type {type_id}, not one of "
                          "ggml's that the gguf package knows", where)
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        row = dims[0] if dims else 1  # ggml counts a missing dimension as 1
        if row % block_size:
            raise damaged(cursor.path, f"the rows of tensor {name!r} ({row} values) are "
                          f"not whole blocks of {block_size} of its type {tensor_type.name}", where)
        offset = cursor.scalar("Q", f"the data offset of tensor {name!r}")
        infos.append(_TensorInfo(name, dims, tensor_type, offset, block_size, type_size, at))
    return infos


def _tensor_type(gguf, type_id):
    try:
        tensor_type = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        return None
    return tensor_type if tensor_type in gguf.GGML_QUANT_SIZES else None


def _alignment(path, metadata, kinds):
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    alignment, kind = metadata["general.alignment"], kinds["general.alignment"]
    where = f"metadata value 'general.alignment' at byte {kind.offset}"
    if kind.kind != 4:
        raise damaged(path, f"the alignment is stored as {KIND_NAMES.get(kind.kind)}, GGUF "
                      "stores it as uint32", where)
    if alignment <= 0 or alignment & (alignment - 1):
        raise damaged(path, f"the alignment {alignment} is not a power of two", where)
    return alignment


def _pad(n, alignment):
    return -(-n // alignment) * alignment


def _place_tensors(path, mapped, order, data_start, alignment, infos):
    """{name: GGUFTensor} viewing the mapped bytes, once each tensor is found to start where
    the ones before it end (padded to the alignment) and to end inside the file."""
    size = len(mapped)
    tensors, expected = {}, 0
    for info in infos:
        name, offset, n_bytes = info.name, info.offset, info.n_bytes
        where = f"tensor {name!r} described at byte {info.at}"
        if offset != expected:  # lower: it shares bytes with the tensor before; higher: a gap
            raise damaged(path, f"tensor {name!r} starts at byte {offset} of the data, where "
                          f"the tensors before it end at {expected} (ggml places them one "
                          f"after the other, each padded to {alignment} bytes)", where)
        start = data_start + offset
        if start + n_bytes > size:
            raise damaged(path, f"tensor {name!r} takes bytes {start} to {start + n_bytes} but "
                          f"the file ends at {size} (it is cut short)", where)
        shape = tuple(reversed(info.dims))
        dtype = _PLAIN.get(info.tensor_type.name)
        if dtype is None:  # quantised: each row a run of blocks of bytes
            dtype = np.uint8
            shape = shape[:-1] + (shape[-1] // info.block_size * info.type_size,)
        dtype = np.dtype(dtype).newbyteorder(order)
        data = mapped[start:start + n_bytes].view(dtype).reshape(shape)
        tensors[name] = GGUFTensor(name, info.tensor_type, info.dims, data)
        expected = _pad(offset + n_bytes, alignment)
    if size > data_start + expected:  # with no tensors: nothing after the header
        raise damaged(path, f"{size - data_start - expected} bytes after the last tensor "
                      "belong to no tensor (a tensor's size in the header is wrong)",
                      f"from byte {data_start + expected}")
    return tensors

