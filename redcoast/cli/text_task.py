"""The task of ``redcoast train``: text records from files, tokenised, batched, and the loss.

Records come from JSON Lines, JSON (a list of objects), CSV or plain text (a record per line),
in one of three formats (TRL's): a ``text`` trained on every token; a ``prompt`` and a
``completion`` trained on the completion alone (causal LM: the prompt's tokens are read, not
predicted; seq2seq: the prompt is the source, the completion the target); or ``messages``, a
conversation rendered by the model's own chat template and trained on the assistant's tokens
alone (redcoast/text/chat_data.py). Each example is a list of token ids, with the end token
appended to text and completions where the tokenizer did not add it (a chat template writes its
own); batches are padded on the right to one length per run, so one step compiles once, and a
weight per target token says what counts. With packing, whole examples share fixed-length rows
instead (redcoast/text/packing.py), each attending within itself.
"""

import csv
import dataclasses
import json
import math
import os

import numpy as np

from ..errors import ConfigError, DataError

TASKS = ("causal_lm", "seq2seq")
FORMATS = ("text", "prompt_completion", "messages")


def read_records(path, text_field="text"):
    """The records of a ``.jsonl``, ``.json``, ``.csv`` or ``.tsv`` file as dicts; any other
    file is text, one record ``{text_field: line}`` per non-empty line."""
    if not os.path.isfile(path):
        raise ConfigError(f"the data file {path} does not exist. Fix: give data.train (and "
                          "data.eval) as paths of .jsonl, .json, .csv or .txt files.")
    ext = os.path.splitext(path)[1].lower()
    with open(path, newline="" if ext in (".csv", ".tsv") else None, encoding="utf-8") as f:
        if ext in (".jsonl", ".ndjson"):
            records = []
            for i, line in enumerate(f):
                if line.strip():
                    records.append(_json(line, f"{path} line {i + 1}"))
        elif ext == ".json":
            records = _json(f.read(), path)
            if not isinstance(records, list):
                raise ConfigError(f"{path} holds a {type(records).__name__}; a .json data file "
                                  "is a list of objects. Fix: write [{...}, ...], or one object "
                                  "per line as .jsonl.")
        elif ext in (".csv", ".tsv"):
            records = list(csv.DictReader(f, delimiter="\t" if ext == ".tsv" else ","))
        else:
            records = [{text_field: line.rstrip("\n")} for line in f if line.strip()]
    if not records:
        raise ConfigError(f"{path} holds no records. Fix: give a file with examples in it.")
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ConfigError(f"{path}: record {i + 1} is {type(record).__name__} "
                              f"({record!r:.60}), not an object with named fields.")
    return records


def _json(text, where):
    try:
        return json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{where} is not valid JSON ({e}). Fix: correct it.") from None


@dataclasses.dataclass(frozen=True)
class Tokens:
    """How text becomes ids: ``tokenizer`` (a ``tokenizers.Tokenizer``), the end token ``eos``
    (appended where the tokenizer's template did not add it; None: none), ``pad`` for padding,
    and ``start``, the decoder's first input (seq2seq)."""

    tokenizer: object
    eos: int | None
    pad: int
    start: int | None = None

    def encode(self, text, special=True):
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def ended(self, ids):
        return ids if self.eos is None or (ids and ids[-1] == self.eos) else ids + [self.eos]


def record_format(first, fields, messages_field="messages"):
    """The format of records like ``first`` (by their fields, messages first), or None.
    ``fields``: the data section's (text_field, prompt_field, completion_field)."""
    text_field, prompt_field, completion_field = fields
    if messages_field in first:
        return "messages"
    if prompt_field in first and completion_field in first:
        return "prompt_completion"
    return "text" if text_field in first else None


def tokenise(records, tokens, task, fields, source, format="auto", messages_field="messages",
             template=None):
    """Each record as ``{"ids", "n_prompt"}`` (causal LM: prompt then completion; the first
    ``n_prompt`` ids are not predicted; messages: ``n_prompt`` 0 and a ``loss_mask``, 1 on the
    ids to predict) or ``{"source", "target"}`` (seq2seq). ``fields``: the data section's
    (text_field, prompt_field, completion_field); ``format``: one of :data:`FORMATS` or
    ``auto`` (by the first record's fields); ``template``: the model's ChatTemplate, for
    messages."""
    text_field, prompt_field, completion_field = fields
    first = records[0]
    found = record_format(first, fields, messages_field)
    allowed = ("prompt_completion",) if task == "seq2seq" else FORMATS
    asked = format if format != "auto" else None
    format = asked or (found if found in allowed else None)
    if format not in allowed or not _has(first, format, fields, messages_field):
        wanted = {"text": f"'{text_field}'", "messages": f"'{messages_field}'",
                  "prompt_completion": f"'{prompt_field}' and '{completion_field}'"}
        need = wanted[format] if format in allowed else ", or ".join(wanted[f] for f in allowed)
        raise ConfigError(f"{source}: its records have the fields {sorted(first)}; {task} "
                          + (f"training on data.format={asked} " if asked else "training ")
                          + f"needs {need}. Fix: set data.text_field, data.prompt_field, "
                          "data.completion_field or data.messages_field to its names"
                          + (", or data.format to the records' format." if asked else "."))
    if format == "messages":
        return [_conversation(record.get(messages_field), i, tokens, template, source,
                              messages_field) for i, record in enumerate(records)]
    paired = format == "prompt_completion"
    examples = []
    for i, record in enumerate(records):
        names = (prompt_field, completion_field) if paired else (text_field,)
        missing = [n for n in names if record.get(n) is None]
        if missing:
            raise ConfigError(f"{source}: record {i + 1} has no {missing[0]!r} (the first "
                              f"record has {list(names)}). Fix: give every record the same fields.")
        if task == "seq2seq":
            examples.append({"source": tokens.ended(tokens.encode(str(record[prompt_field]))),
                             "target": tokens.ended(tokens.encode(str(record[completion_field])))})
        elif paired:
            prompt = tokens.encode(str(record[prompt_field]))
            if prompt and prompt[-1] == tokens.eos:  # a template's end (T5-style): not mid-way
                prompt = prompt[:-1]
            completion = tokens.ended(tokens.encode(str(record[completion_field]), special=False))
            examples.append({"ids": prompt + completion, "n_prompt": len(prompt)})
        else:
            examples.append({"ids": tokens.ended(tokens.encode(str(record[text_field]))),
                             "n_prompt": 0})
    return examples


def _has(record, format, fields, messages_field):
    text_field, prompt_field, completion_field = fields
    names = {"text": (text_field,), "prompt_completion": (prompt_field, completion_field),
             "messages": (messages_field,)}[format]
    return all(n in record for n in names)


def _conversation(messages, index, tokens, template, source, field):
    """One conversation record as ``{"ids", "n_prompt": 0, "loss_mask"}``."""
    from ..text.chat_data import tokenize_conversation

    where = f"{source}: record {index + 1}"
    if template is None:
        raise ConfigError(f"{source} holds conversations ('{field}'), which are rendered by the "
                          "model's chat template, and the model has none. Fix: a model folder "
                          "with chat_template.jinja or a chat_template in tokenizer_config.json "
                          "(a GGUF file with tokenizer.chat_template), or data.format: text.")
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
            for m in messages)):
        raise ConfigError(f"{where}: '{field}' is {messages!r:.80}, not a conversation. Fix: "
                          'a list of {"role": ..., "content": ...} objects, as TRL reads them.')
    try:
        sequence = tokenize_conversation(template, tokens.tokenizer, messages)
    except DataError as e:
        raise ConfigError(f"{where}: {e}") from None
    return {"ids": sequence["input_ids"], "n_prompt": 0, "loss_mask": sequence["loss_mask"]}


def split_records(records, fraction, seed):
    """``(train, held out)``: ``ceil(fraction * n)`` of ``records`` held out, drawn by a
    permutation seeded with ``seed`` (each part in the file's order)."""
    n = len(records)
    n_eval = math.ceil(fraction * n)
    if n_eval >= n:
        raise ConfigError(f"data.eval_fraction={fraction} of {n} records holds out all of them, "
                          "leaving none to train on. Fix: a smaller data.eval_fraction, or more "
                          "records.")
    held = set(np.random.default_rng(seed).permutation(n)[:n_eval].tolist())
    return ([r for i, r in enumerate(records) if i not in held],
            [r for i, r in enumerate(records) if i in held])


def trained_tokens(example):
    """How many of an example's tokens are predicted (what its loss covers)."""
    if "loss_mask" in example:
        return int(sum(example["loss_mask"][1:]))
    if "target" in example:
        return len(example["target"])
    return max(len(example["ids"]) - max(example["n_prompt"], 1), 0)


def packing_rows(examples, length, pad, pack=True):
    """Causal examples as rows of ``length`` tokens (redcoast/text/packing.py): whole examples
    packed into each (``pack``), or one per row; each cut to ``length`` tokens first."""
    from ..text.packing import pack_sequences, pad_sequences

    sequences = []
    for e in examples:
        mask = e.get("loss_mask") or [0] * e["n_prompt"] + [1] * (len(e["ids"]) - e["n_prompt"])
        sequences.append({"input_ids": e["ids"][:length], "loss_mask": mask[:length]})
    return (pack_sequences if pack else pad_sequences)(sequences, length, pad)


def collate_rows(rows):
    """A batch of :func:`packing_rows` rows, as the causal loss reads it (with segment ids)."""
    return {"input_ids": np.stack([r["input_ids"] for r in rows]),
            "labels": np.stack([r["targets"] for r in rows]),
            "weights": np.stack([r["loss_mask"] for r in rows]),
            "segment_ids": np.stack([r["segment_ids"] for r in rows])}


def lengths(examples, max_length):
    """The padded lengths of a run's batches: the longest example's, at most ``max_length``;
    and how many examples are cut. Causal LM: one length (input ids); seq2seq: source, target."""
    keys = ("source", "target") if "source" in examples[0] else ("ids",)
    longest = [max(len(e[k]) for e in examples) for k in keys]
    cut = sum(any(len(e[k]) > max_length + (k == "ids") for k in keys) for e in examples)
    # a causal sequence of L + 1 ids gives L inputs and L targets
    return tuple(min(n - (k == "ids"), max_length) for n, k in zip(longest, keys)), cut


def make_collate_fn(task, shape, pad, start=None):
    """``collate_fn`` padding every batch to ``shape`` (from :func:`lengths`)."""
    if task == "seq2seq":
        source_len, target_len = shape

        def collate_seq2seq(examples):
            source = _padded_rows([e["source"][:source_len] for e in examples], source_len, pad)
            labels = _padded_rows([e["target"][:target_len] for e in examples], target_len, pad)
            weights = _mask([min(len(e["target"]), target_len) for e in examples], target_len)
            decoder_in = np.concatenate([np.full((len(examples), 1), start, np.int32),
                                         labels[:, :-1]], axis=1)
            return {"input_ids": source, "labels": labels, "decoder_input_ids": decoder_in,
                    "attention_mask": _mask([min(len(e["source"]), source_len) for e in examples],
                                            source_len).astype(np.int32),
                    "weights": weights}
        return collate_seq2seq

    (length,) = shape

    def collate_causal(examples):
        ids = _padded_rows([e["ids"][:length + 1] for e in examples], length + 1, pad)
        weights = np.zeros((len(examples), length), np.float32)
        for i, e in enumerate(examples):
            n = min(len(e["ids"]), length + 1)
            if "loss_mask" in e:  # target j is ids[j + 1], weighted by that id's mask
                weights[i, :n - 1] = e["loss_mask"][1:n]
            else:  # the completion's, from the prompt's last token on
                weights[i, max(e["n_prompt"] - 1, 0):n - 1] = 1.0
        return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "weights": weights}
    return collate_causal


def _padded_rows(rows, length, pad):
    out = np.full((len(rows), length), pad, np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def _mask(counts, length):
    return (np.arange(length)[None, :] < np.asarray(counts)[:, None]).astype(np.float32)


def make_loss_fn(model, task, lora=None):
    """Cross-entropy over the weighted target tokens (mean per token of the batch), and their
    accuracy; with ``lora``, its adapters (the trained params) merged into the frozen base."""
    import jax.numpy as jnp
    import optax

    def loss_fn(rng, state, params, batch, is_training):
        if lora is not None:
            params = lora.merge(state.frozen_params, params)
        if task == "seq2seq":
            logits = model.apply(params, batch["input_ids"], batch["attention_mask"],
                                 batch["decoder_input_ids"])
        elif "segment_ids" in batch:  # packed rows: each sequence attends within itself
            logits = model.apply(params, batch["input_ids"], segment_ids=batch["segment_ids"])
        else:  # right padding: causal attention keeps the real tokens from seeing the pad
            logits = model.apply(params, batch["input_ids"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        weights = batch["weights"]
        count = jnp.maximum(jnp.sum(weights), 1.0)
        correct = (jnp.argmax(logits, -1) == batch["labels"]) * weights
        return jnp.sum(losses * weights) / count, {"accuracy": jnp.sum(correct) / count}
    return loss_fn
