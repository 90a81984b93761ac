"""Conversations as training sequences: rendered by the model's own chat template, tokenized,
with a mask over the assistant's tokens, ready for :func:`redcoast.text.packing.pack_sequences`.

Supervised fine-tuning on chat data trains on what the assistant says and on nothing else (the
system prompt and the user's turns are context). The assistant's text is found by rendering the
conversation's prefixes: before each assistant message (with the generation prompt, so the
template's ``<|im_start|>assistant\\n`` or equivalent is context) and just after it; what lies
between, the message and the template's end-of-turn marker, is the assistant's. A template
whose rendering of a prefix is not a prefix of the whole (one that rewrites earlier turns, e.g.
dropping their reasoning) cannot be split so and is an error, not a guess.
"""

import numpy as np

from ..errors import DataError


def assistant_spans(template, messages, **variables):
    """``(text, [(start, end), ...])``: the rendered conversation and the character spans of its
    assistant messages (each with the template's end-of-turn text after it)."""
    text = template.render(messages, add_generation_prompt=False, **variables)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True, **variables)
        through = template.render(messages[:i + 1], add_generation_prompt=False, **variables)
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(
                f"message {i}: the chat template renders the conversation up to this assistant "
                "message as something other than the start of the whole (it rewrites earlier "
                "turns), so the assistant's tokens cannot be told apart. Fix: train on the "
                "rendered text with your own mask, or cut the conversation at this message.")
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_conversation(template, tokenizer, messages, **variables):
    """``{"input_ids": [...], "loss_mask": [...]}`` of one conversation: the template's text
    tokenized by ``tokenizer`` (a ``tokenizers.Tokenizer``), mask 1 on the tokens that start
    inside an assistant message or its end-of-turn marker, 0 elsewhere. ``variables`` (e.g.
    ``tools``) go to the template."""
    text, spans = assistant_spans(template, messages, **variables)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    starts = np.array([start for start, _ in encoding.offsets], dtype=np.int64)
    mask = np.zeros(len(starts), np.int32)
    for start, end in spans:
        mask[(starts >= start) & (starts < end)] = 1
    if spans and not mask.any():
        raise DataError("the assistant's text maps to no token: the tokenizer's offsets do not "
                        "match the rendered text. Fix: use the model's own tokenizer.")
    return {"input_ids": list(encoding.ids), "loss_mask": mask.tolist()}
