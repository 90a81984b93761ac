"""Weight files from strangers: each defect llama.cpp's or safetensors' own loader refuses (and
a few they let through that would load wrong weights silently) is a ConfigError naming the file;
a model folder's index cannot reach files outside the folder.

The GGUF files are written byte by byte (:func:`gguf_bytes`, checked against ``gguf``'s own
reader), so that each can hold exactly one defect.
"""

import json
import os
import struct

import numpy as np
import pytest

from redcoast.errors import ConfigError

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs: pip install gguf")

U32, F32_KIND, STRING, ARRAY = 4, 6, 8, 9
F32, Q8_0 = 0, 8


def gguf_string(text):
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def gguf_bytes(values, tensors, data, alignment=32):
    """A GGUF v3 file: ``values`` [(key, type id, value bytes)], ``tensors`` [(name, dims
    innermost first, type id, offset)] and the data section ``data``, with the padding GGUF
    puts before it."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(values))
    for key, kind, payload in values:
        out += gguf_string(key) + struct.pack("<I", kind) + payload
    for name, dims, kind, offset in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset)
    return out + b"\0" * (-len(out) % alignment) + data


def tokens_value(tokens):
    return ("tokenizer.ggml.tokens", ARRAY,
            struct.pack("<IQ", STRING, len(tokens)) + b"".join(map(gguf_string, tokens)))


A = np.arange(8, dtype=np.float32).reshape(2, 4)
B = -np.arange(8, dtype=np.float32).reshape(2, 4)
# two 32-byte tensors, one after the other
GOOD_TENSORS = [("a", (4, 2), F32, 0), ("b", (4, 2), F32, 32)]
GOOD_DATA = A.tobytes() + B.tobytes()
GOOD_VALUES = [("general.architecture", STRING, gguf_string("llama")),
               tokens_value(["<s>", "</s>", "hi"]),
               ("tokenizer.ggml.eos_token_id", U32, struct.pack("<I", 1))]


def write(tmp_path, data, name="m.gguf"):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def open_gguf(path):
    from redcoast.models.gguf import GGUFFile

    return GGUFFile(path)


def refused(path, match):
    """The ConfigError opening ``path`` raises: it names the file and matches ``match``."""
    with pytest.raises(ConfigError, match=match) as info:
        open_gguf(path)
    assert path in str(info.value) and "Fix" in str(info.value)


def test_the_byte_writer_writes_what_gguf_reads(tmp_path):
    path = write(tmp_path, gguf_bytes(GOOD_VALUES, GOOD_TENSORS, GOOD_DATA))
    reader = gguf.GGUFReader(path)
    assert [t.name for t in reader.tensors] == ["a", "b"]
    np.testing.assert_array_equal(reader.tensors[1].data, B)
    ours = open_gguf(path)
    np.testing.assert_array_equal(ours.tensors["a"].data, A)
    np.testing.assert_array_equal(ours.tensors["b"].data, B)
    assert ours.metadata["tokenizer.ggml.tokens"] == ["<s>", "</s>", "hi"]


def test_two_tensors_at_one_offset_are_refused(tmp_path):
    # b declared over a's bytes: it would read as a copy of a
    tensors = [("a", (4, 2), F32, 0), ("b", (4, 2), F32, 0)]
    refused(write(tmp_path, gguf_bytes(GOOD_VALUES, tensors, GOOD_DATA)),
            r"is damaged: tensor 'b' starts at byte 0 of the data, where the tensors before "
            r"it end at 32")


def test_a_metadata_key_written_twice_is_refused(tmp_path):
    values = GOOD_VALUES + [("tokenizer.ggml.eos_token_id", U32, struct.pack("<I", 2))]
    refused(write(tmp_path, gguf_bytes(values, GOOD_TENSORS, GOOD_DATA)),
            r"is damaged: the metadata key 'tokenizer.ggml.eos_token_id' appears twice")


@pytest.mark.parametrize("key", ["eos", "bos", "padding", "unknown", "eot"])
def test_a_special_token_id_past_the_vocabulary_is_refused(tmp_path, key):
    values = GOOD_VALUES[:2] + [(f"tokenizer.ggml.{key}_token_id", U32, struct.pack("<I", 3))]
    refused(write(tmp_path, gguf_bytes(values, GOOD_TENSORS, GOOD_DATA)),
            rf"special token id 'tokenizer.ggml.{key}_token_id' is 3, outside the vocabulary "
            r"of 3 tokens")


def test_truncated_tensor_data_is_refused(tmp_path):
    data = gguf_bytes(GOOD_VALUES, GOOD_TENSORS, GOOD_DATA)
    refused(write(tmp_path, data[:-5]),
            r"is damaged: tensor 'b' takes bytes \d+ to \d+ but the file ends at \d+")


@pytest.mark.parametrize("field", ["tensors", "values", "array", "string"])
def test_a_count_of_2_to_the_62_is_refused_before_anything_is_allocated(tmp_path, field):
    huge = 2**62
    if field == "array":
        values = [("tokenizer.ggml.scores", ARRAY, struct.pack("<IQ", F32_KIND, huge))]
    elif field == "string":
        values = [("general.name", STRING, struct.pack("<Q", huge) + b"x")]
    else:
        values = GOOD_VALUES
    data = bytearray(gguf_bytes(values, GOOD_TENSORS, GOOD_DATA))
    if field in ("tensors", "values"):
        struct.pack_into("<Q", data, 8 if field == "tensors" else 16, huge)
    refused(write(tmp_path, bytes(data)), r"is damaged: .*(declares 4611686018427387904|"
            r"takes (4611686018427387904|\d{19,}) bytes but the file ends)")


def test_dimensions_whose_product_overflows_are_refused(tmp_path):
    tensors = [("a", (2**32, 2**31, 1, 2), F32, 0)]
    refused(write(tmp_path, gguf_bytes(GOOD_VALUES, tensors, GOOD_DATA)),
            r"the dimensions \(4294967296, 2147483648, 1, 2\) of tensor 'a' hold more elements "
            r"than an int64 counts")


@pytest.mark.parametrize("alignment", [0, 24])
def test_an_alignment_of_zero_or_not_a_power_of_two_is_refused(tmp_path, alignment):
    values = GOOD_VALUES + [("general.alignment", U32, struct.pack("<I", alignment))]
    refused(write(tmp_path, gguf_bytes(values, GOOD_TENSORS, GOOD_DATA)),
            rf"is damaged: the alignment {alignment} is not a power of two")


def test_an_unknown_tensor_type_is_refused(tmp_path):
    tensors = [("a", (4, 2), 4, 0), ("b", (4, 2), F32, 32)]  # 4: Q4_2, long removed from ggml
    refused(write(tmp_path, gguf_bytes(GOOD_VALUES, tensors, GOOD_DATA)),
            r"is damaged: tensor 'a' has type 4, not one of ggml's")


def test_an_unknown_value_type_is_refused_naming_the_file(tmp_path):
    values = GOOD_VALUES + [("general.name", 13, b"x")]
    refused(write(tmp_path, gguf_bytes(values, GOOD_TENSORS, GOOD_DATA)),
            r"is damaged: metadata value 'general.name' has value type 13")


def test_more_than_four_dimensions_are_refused(tmp_path):
    tensors = [("a", (1, 1, 1, 1, 8), F32, 0), ("b", (4, 2), F32, 32)]
    refused(write(tmp_path, gguf_bytes(GOOD_VALUES, tensors, GOOD_DATA)),
            r"tensor 'a' has 5 dimensions, ggml's limit is 4")


@pytest.mark.parametrize("dims, row", [((16, 2), 16), ((), 1)])
def test_rows_that_are_not_whole_blocks_are_refused(tmp_path, dims, row):
    tensors = [("a", dims, Q8_0, 0)]  # Q8_0 packs 32 values a block
    refused(write(tmp_path, gguf_bytes(GOOD_VALUES, tensors, GOOD_DATA)),
            rf"the rows of tensor 'a' \({row} values?\) are not whole blocks of 32")


def test_a_string_that_is_not_utf8_is_refused(tmp_path):
    values = GOOD_VALUES + [("general.name", STRING, struct.pack("<Q", 2) + b"\xff\xfe")]
    refused(write(tmp_path, gguf_bytes(values, GOOD_TENSORS, GOOD_DATA)),
            r"metadata value 'general.name' is not UTF-8 text")


def test_a_tokenizer_value_of_another_type_is_refused(tmp_path):
    # scores as strings: the tokenizer would fail far from the file, or read garbage
    values = GOOD_VALUES + [("tokenizer.ggml.scores", ARRAY, struct.pack("<IQ", STRING, 3)
                             + b"".join(gguf_string(s) for s in "abc"))]
    refused(write(tmp_path, gguf_bytes(values, GOOD_TENSORS, GOOD_DATA)),
            r"'tokenizer.ggml.scores' is an array of string, GGUF's tokenizers store an array "
            r"of float32 there")


def test_bytes_after_the_last_tensor_are_refused(tmp_path):
    # b's size in the header shrunk to 8 of its 16 values: the rest would be dropped silently
    tensors = [("a", (4, 2), F32, 0), ("b", (8, 1), F32, 32)]
    data = A.tobytes() + np.arange(16, dtype=np.float32).tobytes()
    refused(write(tmp_path, gguf_bytes(GOOD_VALUES, tensors, data)),
            r"is damaged: 32 bytes after the last tensor belong to no tensor")


# --- safetensors -----------------------------------------------------------------------------

def safetensors_bytes(header, data):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


GOOD_HEADER = {"a": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]},
               "b": {"dtype": "F32", "shape": [2, 4], "data_offsets": [32, 64]}}


def folder_with(tmp_path, content):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(content)
    return str(folder), str(folder / "model.safetensors")


def header_with(**changes):
    header = json.loads(json.dumps(GOOD_HEADER))
    for name, entry in changes.items():
        header[name].update(entry)
    return header


SAFETENSORS_DEFECTS = {
    "length past the end": (struct.pack("<Q", 10**6) + b"{}", r"header length is 1000000 bytes"),
    "not an object": (safetensors_bytes([1, 2], b""), r"header is a JSON list"),
    "overlapping tensors": (safetensors_bytes(header_with(b={"data_offsets": [16, 48]}),
                                              GOOD_DATA),
                            r"tensor 'b' starts at byte 16 of the data, inside the bytes of "
                            r"tensor 'a'"),
    "same range twice": (safetensors_bytes(header_with(b={"data_offsets": [0, 32]}),
                                           GOOD_DATA[:32]),
                         r"tensor 'b' starts at byte 0 of the data, inside the bytes of "
                         r"tensor 'a'"),
    "unknown dtype": (safetensors_bytes(header_with(a={"dtype": "F31"}), GOOD_DATA),
                      r"tensor 'a' has dtype 'F31'"),
    "negative shape": (safetensors_bytes(header_with(a={"shape": [-2, -4]}), GOOD_DATA),
                       r"tensor 'a' has shape \[-2, -4\], not a list of non-negative"),
    "truncated data": (safetensors_bytes(GOOD_HEADER, GOOD_DATA)[:-4],
                       r"tensor 'b' has data_offsets \[32, 64\], not \[begin, end\] within "
                       r"its 60 bytes"),
    "trailing data": (safetensors_bytes(GOOD_HEADER, GOOD_DATA + b"\0" * 8),
                      r"its tensors cover 64 bytes of data but 72 follow"),
}


@pytest.mark.parametrize("defect", list(SAFETENSORS_DEFECTS))
def test_a_safetensors_header_that_lies_is_named_by_the_folder_reader(tmp_path, defect):
    from redcoast.models.hf import SafetensorsFolder

    content, match = SAFETENSORS_DEFECTS[defect]
    folder, path = folder_with(tmp_path, content)
    with pytest.raises(ConfigError, match=match) as info:
        SafetensorsFolder(folder)
    assert f"{path} is damaged" in str(info.value) and "Fix" in str(info.value)


def test_a_name_written_twice_in_a_safetensors_header_is_refused(tmp_path):
    from redcoast.models.hf import SafetensorsFolder

    entry = '{"dtype":"F32","shape":[2,4],"data_offsets":[0,32]}'
    text = f'{{"a":{entry},"a":{entry}}}'.encode()
    folder, path = folder_with(tmp_path, struct.pack("<Q", len(text)) + text + GOOD_DATA[:32])
    with pytest.raises(ConfigError, match=rf"{path} is damaged: the header names 'a' twice"):
        SafetensorsFolder(folder)


def test_a_damaged_export_names_the_file(tmp_path):
    from redcoast.export import load_params

    path = tmp_path / "params.safetensors"
    path.write_bytes(SAFETENSORS_DEFECTS["length past the end"][0])
    with pytest.raises(ConfigError, match=rf"{path} is damaged: its header length"):
        load_params(str(path), {"a": np.zeros((2, 4), np.float32)})


# --- a folder's index ----------------------------------------------------------------------

def sharded_folder(tmp_path, weight_map, files=None):
    from safetensors.numpy import save_file

    folder = tmp_path / "model"
    folder.mkdir()
    for name, tensors in (files or {}).items():
        save_file(tensors, str(folder / name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(folder)


@pytest.fixture
def elsewhere(tmp_path):
    """A safetensors file outside the model folder."""
    from safetensors.numpy import save_file

    other = tmp_path / "elsewhere"
    other.mkdir()
    save_file({"a": A}, str(other / "x.safetensors"))
    return str(other / "x.safetensors")


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_an_index_cannot_reach_a_file_outside_the_folder(tmp_path, elsewhere, how):
    from redcoast.models.hf import SafetensorsFolder

    if how == "symlink":
        folder = sharded_folder(tmp_path, {"a": "link.safetensors"})
        os.symlink(elsewhere, os.path.join(folder, "link.safetensors"))
        name = "link.safetensors"
    else:
        name = "../elsewhere/x.safetensors" if how == "relative" else elsewhere
        folder = sharded_folder(tmp_path, {"a": name})
    if how == "absolute":
        match = (r"model.safetensors.index.json's entry for tensor 'a' names the absolute path "
                 rf"'{name}', outside")
    else:
        match = (rf"{name} \(.*model.safetensors.index.json's entry for tensor 'a'\) leads "
                 r"outside its folder .*, to .*elsewhere/x.safetensors")
    with pytest.raises(ConfigError, match=match):
        SafetensorsFolder(folder)


def test_a_single_weights_file_linked_from_outside_the_folder_is_refused(tmp_path, elsewhere):
    from redcoast.models.hf import SafetensorsFolder

    folder = tmp_path / "model"
    folder.mkdir()
    os.symlink(elsewhere, folder / "model.safetensors")
    with pytest.raises(ConfigError, match=r"model.safetensors \(the model's weights\) leads "
                       r"outside its folder .*, to .*elsewhere/x.safetensors"):
        SafetensorsFolder(str(folder))


def test_an_index_that_is_not_json_is_named(tmp_path):
    from redcoast.models.hf import SafetensorsFolder

    folder = sharded_folder(tmp_path, {})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        f.write('{"weight_map": {"a": ')
    with pytest.raises(ConfigError, match=r"model.safetensors.index.json cannot be read as "
                       r"JSON"):
        SafetensorsFolder(folder)


def test_the_hub_caches_links_from_a_snapshot_to_its_blobs_are_followed(tmp_path):
    from safetensors.numpy import save_file

    from redcoast.models.hf import SafetensorsFolder

    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    save_file({"a": A}, str(repo / "blobs" / "0f1e"))
    os.symlink("../../blobs/0f1e", snapshot / "model.safetensors")
    np.testing.assert_array_equal(SafetensorsFolder(str(snapshot)).read("a"), A)


@pytest.mark.parametrize("index, match", [
    (["a"], r"holds a JSON list, not an object"),
    ({}, r"has no weight_map of tensor names to file names \(its weight_map is None\)"),
    ({"weight_map": {"a": 3}}, r"has no weight_map of tensor names to file names \(its "
                               r"weight_map is \{'a': 3\}\)"),
    ({"weight_map": {"a": "gone.safetensors"}},
     r"entry for tensor 'a' names 'gone.safetensors', which is not a file in"),
    ({"weight_map": {"a": "one.safetensors", "b": "one.safetensors"}},
     r"places tensor 'b' in .*one.safetensors, which does not hold it"),
])
def test_an_index_that_does_not_describe_its_files_is_named(tmp_path, index, match):
    from redcoast.models.hf import SafetensorsFolder

    folder = sharded_folder(tmp_path, {}, {"one.safetensors": {"a": A}})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(ConfigError, match=match) as info:
        SafetensorsFolder(folder)
    assert "model.safetensors.index.json" in str(info.value)


def test_a_special_token_id_past_the_vocab_size_of_a_file_without_tokens_is_refused(tmp_path):
    from redcoast.models.gguf import hf_config

    counts = {"context_length": 64, "embedding_length": 32, "block_count": 1,
              "feed_forward_length": 64, "attention.head_count": 4, "vocab_size": 10}
    values = [("general.architecture", STRING, gguf_string("llama"))]
    values += [(f"llama.{k}", U32, struct.pack("<I", v)) for k, v in counts.items()]
    values += [("llama.attention.layer_norm_rms_epsilon", F32_KIND, struct.pack("<f", 1e-5)),
               ("tokenizer.ggml.eos_token_id", U32, struct.pack("<I", 10))]
    path = write(tmp_path, gguf_bytes(values, GOOD_TENSORS, GOOD_DATA))
    with pytest.raises(ConfigError, match=rf"{path} is damaged: its eos token id 10 lies outside "
                       r"its vocabulary of 10"):
        hf_config(open_gguf(path))
