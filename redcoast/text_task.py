"""The task of ``redcoast train``: text records from files, tokenised, batched, and the loss.

Records come from JSON Lines, JSON (a list of objects), CSV or plain text (a record per line).
A record with a prompt and a completion is trained on the completion alone (causal LM: the
prompt's tokens are read, not predicted; seq2seq: the prompt is the source, the completion the
target); one with a text on every token. Each example is a list of token ids, with the end
token appended where the tokenizer did not add it; batches are padded on the right to one
length per run, so one step compiles once, and a weight per target token says what counts.
"""

import csv
import dataclasses
import json
import os

import numpy as np

from .errors import ConfigError

TASKS = ("causal_lm", "seq2seq")


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


def tokenise(records, tokens, task, fields, source):
    """Each record as ``{"ids", "n_prompt"}`` (causal LM: prompt then completion; the first
    ``n_prompt`` ids are not predicted) or ``{"source", "target"}`` (seq2seq).
    ``fields``: the data section's (text_field, prompt_field, completion_field)."""
    text_field, prompt_field, completion_field = fields
    first = records[0]
    paired = prompt_field in first and completion_field in first
    if not paired and (task == "seq2seq" or text_field not in first):
        wanted = (f"'{prompt_field}' and '{completion_field}'" if task == "seq2seq" else
                  f"'{text_field}', or '{prompt_field}' and '{completion_field}'")
        raise ConfigError(f"{source}: its records have the fields {sorted(first)}; {task} "
                          f"training needs {wanted}. Fix: set data.text_field, "
                          "data.prompt_field and data.completion_field to its names.")
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
            source = _padded([e["source"][:source_len] for e in examples], source_len, pad)
            labels = _padded([e["target"][:target_len] for e in examples], target_len, pad)
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
        ids = _padded([e["ids"][:length + 1] for e in examples], length + 1, pad)
        weights = np.zeros((len(examples), length), np.float32)
        for i, e in enumerate(examples):
            # target j is ids[j + 1]: the completion's from the prompt's last token on
            weights[i, max(e["n_prompt"] - 1, 0):min(len(e["ids"]), length + 1) - 1] = 1.0
        return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "weights": weights}
    return collate_causal


def _padded(rows, length, pad):
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
        else:  # right padding: causal attention keeps the real tokens from seeing the pad
            logits = model.apply(params, batch["input_ids"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        weights = batch["weights"]
        count = jnp.maximum(jnp.sum(weights), 1.0)
        correct = (jnp.argmax(logits, -1) == batch["labels"]) * weights
        return jnp.sum(losses * weights) / count, {"accuracy": jnp.sum(correct) / count}
    return loss_fn
