"""Opening safetensors files from elsewhere: the header checked first, every error naming the file.

A safetensors file is an 8-byte little-endian header length, a JSON header ({tensor name:
{"dtype", "shape", "data_offsets": [begin, end]}}, optionally "__metadata__": {str: str}) and the
tensors' bytes. :func:`check_header` checks it as the ``safetensors`` package's own reader does
(the header within the file, a JSON object, known dtypes, whole non-negative shapes, each
tensor's bytes exactly its shape's, the tensors one after the other covering the data exactly)
and also refuses a name written twice (JSON keeps the last silently). Each defect is a
:class:`~redcoast.errors.ConfigError` naming the file, the defect and where it lies; errors the
``safetensors`` package raises while opening or reading are wrapped the same way.
"""

import json
import math
import os
import struct

from ..errors import ConfigError

# safetensors' own limit on the header (MAX_HEADER_SIZE in its reader)
MAX_HEADER_BYTES = 100_000_000
# bits per element of each dtype safetensors stores
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
              "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16,
              "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64,
              "F64": 64, "I64": 64, "U64": 64}
_FIELDS = {"dtype", "shape", "data_offsets"}


def damaged(path, what, where, fix):
    """The error for a defect of the safetensors file ``path``."""
    return ConfigError(f"{path} is damaged: {what}, {where} (a damaged or incomplete file: an "
                       f"interrupted save or copy?). Fix: {fix}.")


def check_header(path, fix):
    """The header of the safetensors file ``path`` ({name: entry}, "__metadata__" included),
    after checking it; ``fix`` says in the error how to get an intact file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{path} does not exist or is not a file. Fix: {fix}.")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        start = f.read(8)
        if len(start) < 8:
            raise damaged(path, f"it is {size} bytes long, shorter than the 8-byte header "
                          "length every safetensors file starts with", "at its start", fix)
        (n,) = struct.unpack("<Q", start)
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise damaged(path, f"its header length is {n} bytes but "
                          + (f"only {size - 8} bytes follow" if n > size - 8 else
                             f"safetensors reads headers of at most {MAX_HEADER_BYTES}"),
                          "in bytes 0-7", fix)
        text = f.read(n)
    header = _parse(path, text, fix)
    _check_entries(path, header, size - 8 - n, fix)
    return header


def _parse(path, text, fix):
    def unique(pairs):
        out = {}
        for key, value in pairs:
            if key in out:  # JSON would keep the last one silently
                raise damaged(path, f"the header names {key!r} twice", "in its JSON header",
                              fix)
            out[key] = value
        return out

    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=unique)
    except (UnicodeDecodeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise damaged(path, f"its header is not JSON text ({e})", "from byte 8", fix) from None
    if not isinstance(header, dict):
        raise damaged(path, f"its header is a JSON {type(header).__name__}, not an object",
                      "from byte 8", fix)
    return header


def _check_entries(path, header, data_bytes, fix):
    """Each entry well-formed, and the tensors' byte ranges one after the other covering the
    ``data_bytes`` of data exactly (so no tensor reads another's bytes)."""
    metadata = header.get("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise damaged(path, "its __metadata__ is not a map of strings to strings",
                      "in its JSON header", fix)
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {name!r} in its JSON header"
        if not isinstance(info, dict) or set(info) != _FIELDS:
            raise damaged(path, f"the entry of tensor {name!r} is not {{'dtype', 'shape', "
                          "'data_offsets'}", where, fix)
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPE_BITS:
            raise damaged(path, f"tensor {name!r} has dtype {dtype!r}, not one of "
                          f"safetensors' {sorted(DTYPE_BITS)}", where, fix)
        if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
            raise damaged(path, f"tensor {name!r} has shape {shape!r}, not a list of "
                          "non-negative integers", where, fix)
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
                and offsets[0] <= offsets[1] <= data_bytes):
            raise damaged(path, f"tensor {name!r} has data_offsets {offsets!r}, not [begin, "
                          f"end] within its {data_bytes} bytes of data", where, fix)
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits != 8 * (offsets[1] - offsets[0]):
            raise damaged(path, f"tensor {name!r} of shape {shape} and dtype {dtype} takes "
                          f"{bits / 8:g} bytes but its data_offsets {offsets} span "
                          f"{offsets[1] - offsets[0]}", where, fix)
        ranges.append((offsets[0], offsets[1], name))
    end, before = 0, None
    for begin, stop, name in sorted(ranges):
        if begin != end:
            what = (f"tensor {name!r} starts at byte {begin} of the data, inside the bytes of "
                    f"tensor {before!r}" if begin < end else
                    f"bytes {end} to {begin} of the data belong to no tensor")
            raise damaged(path, what, f"tensor {name!r} in its JSON header", fix)
        end, before = stop, name
    if end != data_bytes:
        raise damaged(path, f"its tensors cover {end} bytes of data but {data_bytes} follow the "
                      "header (a shape in it is wrong, or bytes were appended)",
                      "at its end", fix)


def _is_count(x):
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def wrapped(path, fix, what, call):
    """``call()``, with an error of the ``safetensors`` package (which names no file) turned
    into a :class:`ConfigError` naming ``path`` and ``fix``."""
    try:
        return call()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own and builtin types
        raise ConfigError(f"{path} cannot be {what} ({type(e).__name__}: {e}). Fix: "
                          f"{fix}.") from e


def open_safetensors(path, fix):
    """``safetensors.safe_open(path, framework="numpy")`` once its header is checked."""
    from safetensors import safe_open

    check_header(path, fix)
    return wrapped(path, fix, "opened as safetensors",
                   lambda: safe_open(os.fspath(path), framework="numpy"))


def load_safetensors(path, fix):
    """{name: numpy array} of every tensor in the safetensors file ``path``, once its header is
    checked; ``fix`` says in an error how to get an intact file."""
    from safetensors.numpy import load_file

    check_header(path, fix)
    return wrapped(path, fix, "read as safetensors", lambda: load_file(os.fspath(path)))
