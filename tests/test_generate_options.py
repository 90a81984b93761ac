"""generate's defaults (EOS and pad from the model) and transformers' basic options (repetition
penalty, min_new_tokens, min_length, no-repeat n-grams, forced BOS / EOS) against transformers'
generate on the same random tiny Llama, greedy and with beam search; stop sequences and stop
strings against their definition."""

import json
import re

import numpy as np
import pytest

from redcoast.errors import ConfigError
from redcoast.models import Model, llama
from redcoast.models.generate import cut_at_stop_strings, generate, split_completions
from test_generate import (IDS, MASK, PAD, TINY, free_greedy, hf_generate,  # noqa: F401 (fixtures)
                           needs_torch, tiny)

# Unpadded prompts of one length: transformers counts the prompt's pad tokens in its history
# (penalised, in n-grams), redcoast only real tokens; without padding the two agree.
EQUAL = np.array([[1, 17, 45, 9, 80, 33], [1, 88, 21, 54, 3, 60], [1, 60, 72, 60, 72, 5]],
                 np.int32)
ONE_TOKEN = np.array([[1], [5], [9]], np.int32)
N = 10
EOS = [2]


def ours(model, params, ids, **kw):
    kw = {"eos_token_id": EOS, "pad_token_id": PAD, **kw}
    return np.asarray(generate(model, params, ids, max_new_tokens=N, **kw))


def theirs(reference, ids, **kw):
    import torch

    kw = {"eos_token_id": EOS, **kw}
    with torch.no_grad():
        out = reference.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                                 attention_mask=torch.ones(ids.shape, dtype=torch.long),
                                 max_new_tokens=N, do_sample=False, pad_token_id=PAD, **kw)
    new = out[:, ids.shape[1]:].numpy()
    return np.pad(new, ((0, 0), (0, N - new.shape[1])), constant_values=PAD)


def early_token(model, params):
    """A token plain greedy decoding gives early in row 0 (an EOS that min_new_tokens delays)."""
    return int(ours(model, params, EQUAL, eos_token_id=())[0, 1])


OPTIONS = {
    "repetition_penalty": dict(repetition_penalty=1.8),
    "repetition_reward": dict(repetition_penalty=0.6),
    "no_repeat_bigrams": dict(no_repeat_ngram_size=2),
    "no_repeat_tokens": dict(no_repeat_ngram_size=1),
    "forced_eos": dict(forced_eos_token_id=7),
    "together": dict(repetition_penalty=1.3, no_repeat_ngram_size=3, forced_eos_token_id=[7, 8]),
}
IN_DEFAULT_SUITE = {"together"}  # the others, a few seconds each, in the slow step


@needs_torch
@pytest.mark.parametrize("name", [n if n in IN_DEFAULT_SUITE else
                                  pytest.param(n, marks=pytest.mark.slow) for n in OPTIONS])
def test_each_option_equals_transformers(tiny, name):
    reference, model, params = tiny
    options = OPTIONS[name]
    plain = ours(model, params, EQUAL)
    got = ours(model, params, EQUAL, **options)
    assert not np.array_equal(got, plain), "the option changed nothing here: a useless test"
    np.testing.assert_array_equal(got, theirs(reference, EQUAL, **options))


@needs_torch
@pytest.mark.slow  # 9 s
def test_min_new_tokens_and_forced_bos_equal_transformers(tiny):
    reference, model, params = tiny
    eos = early_token(model, params)
    early = ours(model, params, EQUAL, eos_token_id=eos)
    assert early[0, 2] == PAD  # row 0 stops after two tokens without the option
    delayed = ours(model, params, EQUAL, eos_token_id=eos, min_new_tokens=6)
    assert (delayed[0, :6] != eos).all() and delayed[0, 2] != PAD
    np.testing.assert_array_equal(delayed, theirs(reference, EQUAL, eos_token_id=eos,
                                                  min_new_tokens=6))
    # forced BOS applies when the history is a single token, as in transformers
    forced = ours(model, params, ONE_TOKEN, forced_bos_token_id=42)
    assert (forced[:, 0] == 42).all()
    np.testing.assert_array_equal(forced, theirs(reference, ONE_TOKEN, forced_bos_token_id=42))
    assert (ours(model, params, EQUAL, forced_bos_token_id=42) == ours(model, params, EQUAL)).all()


BEAMS = dict(num_beams=3, eos_token_id=[15, 6])  # EOS tokens the tiny model gives in beams
BEAM_OPTIONS = {
    "repetition_penalty": dict(repetition_penalty=1.8),
    "repetition_reward": dict(repetition_penalty=0.6, length_penalty=0.5,
                              early_stopping="never"),
    "no_repeat_bigrams": dict(no_repeat_ngram_size=2),
    "forced_eos": dict(forced_eos_token_id=7),
    "together": dict(repetition_penalty=1.3, no_repeat_ngram_size=3, forced_eos_token_id=[7, 8],
                     length_penalty=2.0, early_stopping=True),
}


@needs_torch
@pytest.mark.parametrize("name", [n if n in IN_DEFAULT_SUITE else
                                  pytest.param(n, marks=pytest.mark.slow) for n in BEAM_OPTIONS])
def test_each_option_with_beam_search_equals_transformers(tiny, name):
    """transformers applies its processors to each beam's log-probabilities and history."""
    reference, model, params = tiny
    options = {**BEAMS, **BEAM_OPTIONS[name]}
    plain = ours(model, params, EQUAL, **BEAMS)
    got = ours(model, params, EQUAL, **options)
    assert not np.array_equal(got, plain), "the option changed nothing here: a useless test"
    np.testing.assert_array_equal(got, theirs(reference, EQUAL, **options))


@needs_torch
@pytest.mark.slow  # 8 beam searches compiled: a minute on two shared cores
def test_min_length_min_new_tokens_and_forced_bos_with_beam_search_equal_transformers(tiny):
    reference, model, params = tiny
    # as EOS, the second token of row 0's best hypothesis: it then ends after two tokens
    eos = [int(ours(model, params, EQUAL, **{**BEAMS, "eos_token_id": ()})[0, 1])]
    early = ours(model, params, EQUAL, **{**BEAMS, "eos_token_id": eos})
    assert early[0, 1] == eos[0] and early[0, 2] == PAD
    width = EQUAL.shape[1]
    for options in (dict(min_new_tokens=4), dict(min_length=width + 4)):
        options = {**BEAMS, "eos_token_id": eos, **options}
        delayed = ours(model, params, EQUAL, **options)
        assert (delayed[:, :4] != eos[0]).all() and delayed[0, 2] != PAD
        np.testing.assert_array_equal(delayed, theirs(reference, EQUAL, **options))
    # min_new_tokens wins over min_length where both are set, as in transformers
    both = {**BEAMS, "eos_token_id": eos, "min_new_tokens": 2, "min_length": width + 6}
    np.testing.assert_array_equal(ours(model, params, EQUAL, **both),
                                  theirs(reference, EQUAL, **both))
    np.testing.assert_array_equal(ours(model, params, EQUAL, **both),
                                  ours(model, params, EQUAL, **{**both, "min_length": 0}))
    forced = ours(model, params, ONE_TOKEN, **BEAMS, forced_bos_token_id=42)
    assert (forced[:, 0] == 42).all()
    np.testing.assert_array_equal(forced, theirs(reference, ONE_TOKEN, **BEAMS,
                                                 forced_bos_token_id=42))


@needs_torch
def test_eos_and_pad_default_to_the_folders_generation_config(tiny, free_greedy, tmp_path):
    from redcoast.models import from_pretrained

    reference, model, params = tiny
    eos = int(free_greedy[1, 3])
    folder = tmp_path / "with_generation_config"
    reference.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [eos, 94], "pad_token_id": PAD}))
    model, params = from_pretrained(folder)
    tokens = generate(model, params, IDS, MASK, max_new_tokens=8)  # no option given
    expected = hf_generate(reference, eos_token_id=[eos, 94])
    assert (expected == PAD).any()
    np.testing.assert_array_equal(tokens, expected)


def test_eos_defaults_to_the_models_config_and_empty_means_none(tiny, free_greedy):
    _, model, params = tiny
    eos = int(free_greedy[1, 3])
    config = llama.LlamaConfig(**{**TINY, "eos_token_id": eos, "pad_token_id": PAD})
    with_eos = Model(llama.LlamaForCausalLM, config)
    tokens = np.asarray(generate(with_eos, params, IDS, MASK, max_new_tokens=8))
    np.testing.assert_array_equal(tokens, generate(with_eos, params, IDS, MASK, max_new_tokens=8,
                                                   eos_token_id=eos, pad_token_id=PAD))
    assert list(tokens[1, 4:]) == [PAD] * 4
    np.testing.assert_array_equal(generate(with_eos, params, IDS, MASK, max_new_tokens=8,
                                           eos_token_id=()), free_greedy)


def test_stop_sequences_end_a_row_like_eos(tiny, free_greedy):
    _, model, params = tiny
    stop = [int(t) for t in free_greedy[0, 2:4]]
    tokens = np.asarray(generate(model, params, IDS, MASK, max_new_tokens=8, eos_token_id=(),
                                 pad_token_id=PAD, stop_sequences=[stop, [93, 93, 93]]))
    expected = free_greedy.copy()
    for row in range(3):  # each row up to (and with) the first occurrence of the sequence
        for i in range(1, 8):
            if list(free_greedy[row, i - 1:i + 1]) == stop:
                expected[row, i + 1:] = PAD
                break
    assert (expected[0, 4:] == PAD).all()
    np.testing.assert_array_equal(tokens, expected)


class Letters:
    """A tokenizer whose token t is the letter 'a' + t % 26."""

    @staticmethod
    def decode(ids):
        return "".join(chr(ord("a") + int(t) % 26) for t in ids)


def test_stop_strings_cut_each_row_after_the_token_that_completes_them(tiny, free_greedy):
    _, model, params = tiny
    text = Letters.decode(free_greedy[2])
    stop = text[3:5]  # ends at token 4 of row 2
    tokens = generate(model, params, IDS, MASK, max_new_tokens=8, eos_token_id=(),
                      pad_token_id=PAD, stop_strings=stop, tokenizer=Letters())
    first = text.index(stop) + len(stop)
    assert list(tokens[2, first:]) == [PAD] * (8 - first)
    np.testing.assert_array_equal(tokens[2, :first], free_greedy[2, :first])
    cut = cut_at_stop_strings(free_greedy, Letters(), [stop], PAD)
    np.testing.assert_array_equal(tokens, cut)


def test_split_completions_keep_each_row_up_to_its_first_eos():
    # generate's rows (padded after their first EOS, here 2 or 7), cut as an RL step needs them:
    # a row that never stopped is kept whole, a stop in the first slot is a completion too
    rows = np.array([[5, 2, PAD, PAD], [5, 6, 7, 8], [7, PAD, PAD, PAD], [9, 9, 9, 2]])
    assert split_completions(rows, [2, 7]) == [[5, 2], [5, 6, 7], [7], [9, 9, 9, 2]]
    assert split_completions(rows, 2) == [[5, 2], [5, 6, 7, 8], [7, PAD, PAD, PAD], [9, 9, 9, 2]]


def test_option_errors_name_the_fix(tiny):
    _, model, params = tiny
    cases = [(dict(repetition_penalty=0.0), "repetition_penalty=0.0; it must be > 0"),
             (dict(min_new_tokens=-1), "min_new_tokens=-1; it must be an integer >= 0"),
             (dict(min_new_tokens=9), "min_new_tokens=9 is more than max_new_tokens=8"),
             (dict(stop_sequences=[[5]], num_beams=2), "not yet with beam search"),
             (dict(min_length=7 + 9), "min_length=16 is more than the 7 tokens before"),
             (dict(min_length=-1), "min_length=-1; it must be an integer >= 0"),
             (dict(stop_sequences=[[]]), "empty sequence"),
             (dict(stop_strings=["x"]), "stop_strings needs tokenizer"),
             (dict(forced_eos_token_id="x"), "forced_eos_token_id='x'; give a token id")]
    for options, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            generate(model, params, IDS, MASK, max_new_tokens=8, **options)


def test_empty_or_non_text_stop_strings_are_refused_before_generating(tiny, free_greedy):
    # "" is in every text: it cut every row after its first token, silently
    _, model, params = tiny
    cases = [([""], "holds an empty string"), ("", "holds an empty string"),
             (["ab", None], "holds None (NoneType)"), ([3], "holds 3 (int)"),
             ([b"ab"], "holds b'ab' (bytes)"), (7, "stop_strings=7 is no text to stop at")]
    for stop, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)) as caught:
            generate(model, params, IDS, MASK, max_new_tokens=8, eos_token_id=(),
                     pad_token_id=PAD, stop_strings=stop, tokenizer=Letters())
        assert "stop_strings" in str(caught.value) and "Fix" in str(caught.value)
        with pytest.raises(ConfigError, match=re.escape(message)):
            cut_at_stop_strings(free_greedy, Letters(), [stop] if stop == "" else stop, PAD)
    # none at all stays allowed, and cuts nothing
    for none in (None, (), []):
        np.testing.assert_array_equal(
            generate(model, params, IDS, MASK, max_new_tokens=8, eos_token_id=(),
                     pad_token_id=PAD, stop_strings=none, tokenizer=Letters()), free_greedy)


def test_a_folder_without_generation_config_gives_an_empty_one(tmp_path):
    from redcoast.models.pretrained import read_generation_config

    assert read_generation_config(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="generation_config.json cannot be read"):
        read_generation_config(tmp_path)


@needs_torch
def test_search_options_default_to_the_folders_generation_config_as_in_transformers(tiny, tmp_path):
    import torch
    import transformers

    from redcoast.models import from_pretrained

    reference, _, _ = tiny
    folder = tmp_path / "with_search_defaults"
    reference.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": EOS, "pad_token_id": PAD, "repetition_penalty": 1.3,
         "no_repeat_ngram_size": 3}))
    model, params = from_pretrained(folder)
    got = np.asarray(generate(model, params, EQUAL, max_new_tokens=N))  # no option given
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()  # reads the same file
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(EQUAL, dtype=torch.long),
                          attention_mask=torch.ones(EQUAL.shape, dtype=torch.long),
                          max_new_tokens=N)
    new = out[:, EQUAL.shape[1]:].numpy()
    np.testing.assert_array_equal(got, np.pad(new, ((0, 0), (0, N - new.shape[1])),
                                              constant_values=PAD))
    # the file changed the tokens, and a call's own values win over it
    plain = ours(model, params, EQUAL, repetition_penalty=1.0, no_repeat_ngram_size=0)
    assert not np.array_equal(got, plain)
    np.testing.assert_array_equal(plain, ours(tiny[1], tiny[2], EQUAL))


@pytest.mark.slow  # 5 s: two sampling searches compiled
def test_sampling_asked_for_by_the_file_alone_needs_a_key_and_top_k_is_50_by_default(tiny):
    import jax

    _, model, params = tiny
    sampling = Model(model.module_cls, model.config)
    sampling.generation_config = {"do_sample": True, "temperature": 0.7}
    with pytest.raises(ConfigError, match=r"generation_config.json asks for sampling.*Fix: pass rng="):
        generate(sampling, params, EQUAL, max_new_tokens=N)
    key = jax.random.key(3)
    drawn = np.asarray(generate(sampling, params, EQUAL, max_new_tokens=N, rng=key))
    # the same compiled search, asked for by the call (top_k 50 is the default)
    np.testing.assert_array_equal(drawn, generate(sampling, params, EQUAL, max_new_tokens=N, rng=key,
                                                  do_sample=True, temperature=0.7, top_k=50))
    assert not np.array_equal(drawn, generate(sampling, params, EQUAL, max_new_tokens=N, rng=key,
                                              top_k=0))
