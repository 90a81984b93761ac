"""Damaged copies of a small valid GGUF file and a small valid safetensors file, seeded: single
bit flips in their headers and truncations anywhere. Each copy either loads exactly as the
original did (metadata and tensors), or is refused with a ConfigError naming the file; any other
exception fails, and so does a load that differs from the original.

One exception to "as the original": a flip inside a *content* byte, the text of a key, a name or
a string value or the bytes of a number, changes what the file says without breaking its form
(neither format has a checksum; no reader can tell). Such a copy may load, and must then load
exactly as the format's own reader (``gguf.GGUFReader``, ``safetensors.safe_open``) reads that
same copy. Every other byte (magic, version, counts, lengths, types, dimensions, offsets, JSON
syntax, dtypes, shapes, data offsets, padding) is structure: damage there must be refused, or
leave the load unchanged.

Bit flips, not arbitrary byte values: two kinds of structural damage no reader can see are
reachable by the latter and kept out of the files here. A GGUF file's last tensor shrunk or
grown by less than the alignment keeps its end inside the padding (llama.cpp cannot tell
either); the other dimensions of a tensor with a zero dimension change no byte count. With
these files' shapes no single bit flip gets there.
"""

import json
import os
import struct

import numpy as np
import pytest

from redcoast.errors import ConfigError

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs: pip install gguf")

N_FLIPS, N_CUTS = 300, 60


def write_gguf(path):
    """A tiny Llama file, written with gguf's own writer: its hyperparameters, a byte-level
    tokenizer and one layer's tensors in F32, F16 and Q8_0."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    tokens = ["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġa", "c"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 1, 1, 1, 1, 1, 1])
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_tensor("token_embd.weight", rng.normal(size=(8, 32)).astype(np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", rng.normal(size=32).astype(np.float16))
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    q = rng.normal(size=(32, 32)).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(q, q8_0), raw_dtype=q8_0)
    writer.add_tensor("output_norm.weight", rng.normal(size=(32,)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_gguf(path):
    """What redcoast makes of a GGUF file: its metadata, Hugging Face config and every tensor
    dequantised, and the raw tensors as mapped (compared with gguf's reader)."""
    from redcoast.models.gguf import read_gguf

    config, tensors = read_gguf(path)
    raw = {name: (t.tensor_type, tuple(t.shape), np.array(t.data))
           for name, t in tensors.file.tensors.items()}
    return {"metadata": dict(tensors.file.metadata), "config": config, "raw": raw,
            "values": {name: np.array(tensors[name]) for name in tensors}}


def gguf_reference(path):
    """gguf.GGUFReader's reading of a file, as :func:`load_gguf`'s metadata and raw tensors."""
    reader = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    raw = {t.name: (t.tensor_type, tuple(int(d) for d in t.shape), np.array(t.data))
           for t in reader.tensors}
    return metadata, raw


def gguf_content_bytes(path):
    """The bytes of a GGUF file that hold content, not form: key and tensor-name text, string
    values and numbers (the parts gguf's reader marks as a field's data)."""
    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data
    parts = []
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            parts += [field.parts[1]] + [field.parts[i] for i in field.data]
    parts += [t.field.parts[1] for t in reader.tensors]
    return {p.ctypes.data - base + i for p in parts for i in range(p.nbytes)}, reader.data_offset


def write_safetensors(path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    save_file({"weight": rng.normal(size=(4, 8)).astype(np.float32),
               "bias": rng.normal(size=8).astype(np.float16),
               "ids": np.arange(6, dtype=np.int32).reshape(3, 2)}, str(path),
              metadata={"format": "pt"})


def load_safetensors(path):
    """What redcoast makes of a safetensors file (its shared validated open): metadata and
    every tensor."""
    from redcoast.store.safetensors_check import open_safetensors

    with open_safetensors(path, "write it again") as f:
        return f.metadata(), {name: f.get_tensor(name) for name in f.keys()}


def safetensors_reference(path):
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        return f.metadata(), {name: f.get_tensor(name) for name in f.keys()}


def safetensors_content_bytes(path):
    """The bytes inside the JSON strings that are tensor names or __metadata__ text, and the
    size of the header (length and JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        text = f.read(n).decode()
    header = json.loads(text)
    strings = set(header) - {"__metadata__"}
    strings |= {s for kv in header.get("__metadata__", {}).items() for s in kv}
    content, i = set(), 0
    while (i := text.find('"', i)) != -1:
        end = text.index('"', i + 1)  # the writer escapes nothing in these names
        if text[i + 1:end] in strings:
            content.update(range(8 + i + 1, 8 + end))
        i = end + 1
    return content, 8 + n


def equal(a, b):
    """Deep equality of loads: dicts, tuples, numpy arrays (bitwise, dtype and shape too)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    return type(a) is type(b) and (a == b or (a != a and b != b))


def damaged_copies(original, header_end, rng):
    """[(description, bytes, flipped byte or None)]: bit flips in the header, truncations."""
    copies = []
    for _ in range(N_FLIPS):
        at, bit = int(rng.integers(header_end)), int(rng.integers(8))
        data = bytearray(original)
        data[at] ^= 1 << bit
        copies.append((f"bit {bit} of byte {at} flipped", bytes(data), at))
    for _ in range(N_CUTS):
        n = int(rng.integers(len(original)))
        copies.append((f"cut to {n} bytes", original[:n], None))
    return copies


def check(kind, description, path, outcome, original, content, reference, at):
    """The rule of this test for one damaged copy (see the module's docstring)."""
    if isinstance(outcome, ConfigError):
        assert path in str(outcome), f"{kind}, {description}: the error names no file: {outcome}"
        return
    if isinstance(outcome, BaseException):
        raise AssertionError(f"{kind}, {description}: {type(outcome).__name__}: "
                             f"{outcome}") from outcome
    if equal(outcome, original):
        return
    assert at is not None and at in content, (
        f"{kind}, {description}: a structural byte changed, the load differs from the "
        "original and nothing was refused")
    assert reference(), f"{kind}, {description}: loaded differently from the format's reader"


def attempt(load, path):
    try:
        return load(path)
    except Exception as e:  # noqa: BLE001 - the outcome is judged by check()
        return e


def fuzz(tmp_path, kind, source, load, content_bytes, reference_of):
    """Loads each damaged copy of `source` and judges it; returns how many ended each way."""
    original_bytes = source.read_bytes()
    original = load(str(source))
    content, data_start = content_bytes(str(source))
    rng = np.random.default_rng(48)
    outcomes = {"refused": 0, "same": 0, "content": 0}
    for i, (description, data, at) in enumerate(damaged_copies(original_bytes, data_start, rng)):
        path = str(tmp_path / f"copy{i}{source.suffix}")
        with open(path, "wb") as f:
            f.write(data)
        outcome = attempt(load, path)
        check(kind, description, path, outcome, original, content,
              lambda: reference_of(outcome, path), at)
        outcomes["refused" if isinstance(outcome, ConfigError) else
                 "same" if equal(outcome, original) else "content"] += 1
        os.remove(path)
    # the damage was mostly found: the test would pass vacuously if nothing were refused
    assert outcomes["refused"] > N_CUTS and outcomes["content"] < N_FLIPS // 3, outcomes


def gguf_read_as_the_reference(outcome, path):
    metadata, raw = gguf_reference(path)
    return equal(outcome["metadata"], metadata) and equal(outcome["raw"], raw)


@pytest.mark.slow  # ~3 s: 360 damaged files opened, each also by the format's own reader
def test_damaged_gguf_files_load_as_the_original_or_are_refused_naming_the_file(tmp_path):
    source = tmp_path / "tiny.gguf"
    write_gguf(source)
    fuzz(tmp_path, "GGUF", source, load_gguf, gguf_content_bytes, gguf_read_as_the_reference)


@pytest.mark.slow
def test_damaged_safetensors_files_load_as_the_original_or_are_refused_naming_the_file(
        tmp_path):
    source = tmp_path / "tiny.safetensors"
    write_safetensors(source)
    fuzz(tmp_path, "safetensors", source, load_safetensors, safetensors_content_bytes,
         lambda outcome, path: equal(outcome, safetensors_reference(path)))
