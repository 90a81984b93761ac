"""Conversations as training sequences (redcoast/text/chat_data.py): the assistant's tokens, found
through the chat template, against the assistant's own text."""

import numpy as np
import pytest

from redcoast.text.chat_data import tokenize_conversation
from redcoast.errors import DataError
from redcoast.models.chat_template import ChatTemplate
from redcoast.text.packing import pack_sequences, pad_sequences

pytest.importorskip("jinja2")
tokenizers = pytest.importorskip("tokenizers")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "12 + 30 = 42."},
    {"role": "user", "content": "And 7 * 6?"},
    {"role": "assistant", "content": "7 * 6 = 42 as well."},
]


def byte_level_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [ChatTemplate(CHATML).render(CONVERSATION, add_generation_prompt=False)] * 4
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer


def test_the_mask_covers_the_assistants_text_and_end_of_turn_only():
    tokenizer = byte_level_bpe()
    out = tokenize_conversation(ChatTemplate(CHATML), tokenizer, CONVERSATION)
    ids, mask = np.array(out["input_ids"]), np.array(out["loss_mask"])
    assert len(ids) == len(mask) and set(mask.tolist()) == {0, 1}
    said = tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    assert said == "12 + 30 = 42.<|im_end|>\n7 * 6 = 42 as well.<|im_end|>\n"
    # everything together is the rendered conversation, nothing lost or added
    assert tokenizer.decode(ids.tolist(), skip_special_tokens=False) == \
        ChatTemplate(CHATML).render(CONVERSATION, add_generation_prompt=False)
    # the user's question and the generation prompt are context
    context = tokenizer.decode(ids[mask == 0].tolist(), skip_special_tokens=False)
    assert "What is 12 + 30?" in context and context.endswith("<|im_start|>assistant\n")


def test_a_template_that_rewrites_earlier_turns_is_an_error():
    # drops every assistant message but the last, as templates that hide past reasoning do
    rewriting = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                 "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(DataError, match="message 2: .*rewrites earlier turns"):
        tokenize_conversation(ChatTemplate(rewriting), byte_level_bpe(), CONVERSATION)


def test_padded_rows_are_packed_rows_of_one_sequence():
    sequences = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, [8, 9, 10, 11, 12]]
    padded = pad_sequences(sequences, 6)
    assert len(padded) == 2
    for row, sequence in zip(padded, sequences):
        (alone,) = pack_sequences([sequence], 6)
        assert row.keys() == alone.keys()
        for key in row:
            np.testing.assert_array_equal(row[key], alone[key])
    np.testing.assert_array_equal(padded[0]["loss_mask"], [1, 1, 0, 0, 0, 0])
    with pytest.raises(DataError, match="sequence 1 has 5 tokens, more than seq_len=4"):
        pad_sequences(sequences, 4)
