"""A GGUF file's header read in one pass: its metadata as Python values and where each tensor's
bytes lie (mapped, not read).

``gguf.GGUFReader`` builds a numpy view of the mapped file for every value it parses, one per
token of a tokenizer's vocabulary and merges: SmolLM2-135M's header (49,152 tokens, 48,900
merges) took it 6.0 s here, a Llama 3 vocabulary several times that. The format (GGUF versions 2
and 3, github.com/ggml-org/ggml/blob/master/docs/gguf.md) is a flat sequence of little- or
big-endian values; this reads it with ``struct`` and keeps ``gguf``'s own tables of tensor types
and block sizes and its dequantisers. tests/test_models_gguf.py compares every value and tensor
with ``GGUFReader``'s on the packaged model and on a file of every value type.
"""

import dataclasses
import struct

import numpy as np

from ..errors import ConfigError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF's value types: id -> struct format (scalars); 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
# GGML's unquantised tensor types, viewed as numpy's (the rest are blocks of bytes)
_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: ``shape`` lists GGUF's dimensions innermost first (as
    ``gguf.ReaderTensor.shape``), ``data`` the mapped bytes viewed as ``gguf`` views them (the
    element type for plain types, uint8 blocks for quantised ones)."""
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple
    data: np.ndarray


class _Cursor:
    """Reads values of one byte order from a buffer, advancing an offset."""

    def __init__(self, buffer, order, offset):
        self.buffer, self.order, self.offset = buffer, order, offset

    def scalar(self, fmt):
        (value,) = struct.unpack_from(self.order + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self):
        n = self.scalar("Q")
        start, self.offset = self.offset, self.offset + n
        return bytes(self.buffer[start:self.offset]).decode("utf-8")

    def value(self, kind):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, n = self.scalar("I"), self.scalar("Q")
            if item_kind in _SCALARS and item_kind != 7:  # numbers: one view for them all
                dtype = np.dtype(self.order + _SCALARS[item_kind])
                items = np.frombuffer(self.buffer, dtype, n, self.offset)
                self.offset += n * dtype.itemsize
                return items.tolist()
            return [self.value(item_kind) for _ in range(n)]
        raise ConfigError(f"GGUF value type {kind} at byte {self.offset} is not one of GGUF's; "
                          "the file is damaged or of a newer GGUF version.")


def read_header(path, gguf):
    """``(version, metadata, tensors)`` of the GGUF file at ``path``: ``metadata`` {key: Python
    value (lists for arrays)}, ``tensors`` {name: :class:`GGUFTensor`}. ``gguf``: the ``gguf``
    package (its tensor-type tables)."""
    mapped = np.memmap(path, mode="r")
    # the header through a memoryview: slicing it costs nothing (a numpy view of a memmap is
    # what makes GGUFReader slow); the tensors below are views of the same mapping
    buffer = memoryview(mapped)
    if bytes(buffer[:4]) != MAGIC:
        raise ConfigError(f"{path} is not a GGUF file (it does not start with b'GGUF').")
    order = "<"
    version = struct.unpack_from("<I", buffer, 4)[0]
    if version & 0xFFFF == 0:  # written on a big-endian machine
        order, version = ">", struct.unpack_from(">I", buffer, 4)[0]
    if version not in VERSIONS:
        raise ConfigError(f"{path} is GGUF version {version}; redcoast reads versions "
                          f"{VERSIONS} (convert it with a current llama.cpp).")
    cursor = _Cursor(buffer, order, 8)
    n_tensors, n_values = cursor.scalar("Q"), cursor.scalar("Q")
    metadata = {}
    for _ in range(n_values):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("I"))
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = tuple(cursor.scalar("Q") for _ in range(cursor.scalar("I")))
        infos.append((name, dims, cursor.scalar("I"), cursor.scalar("Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in infos:
        if name in tensors:
            raise ConfigError(f"{path} holds two tensors named {name!r}; the file is damaged.")
        tensor_type = gguf.GGMLQuantizationType(type_id)
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        n_elements = int(np.prod(dims, dtype=np.int64))
        shape = tuple(reversed(dims))
        dtype = _PLAIN.get(tensor_type.name)
        if dtype is None:  # quantised: blocks of bytes
            dtype, shape = np.uint8, gguf.quants.quant_shape_to_byte_shape(shape, tensor_type)
        dtype = np.dtype(dtype).newbyteorder(order)
        start = data_start + offset
        n_bytes = n_elements * type_size // block_size
        data = mapped[start:start + n_bytes].view(dtype).reshape(shape)
        tensors[name] = GGUFTensor(name, tensor_type, dims, data)
    return version, metadata, tensors

