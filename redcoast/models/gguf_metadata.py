"""The metadata of a GGUF file checked where a wrong value would load silently: the tokenizer's
values stored as llama.cpp stores (and reads) them, its per-token arrays one item per token, and
every special token id (BOS, EOS, padding, ...) a token of the vocabulary: an EOS past it is
never generated, so generation could never stop.
"""

import re

from .gguf_header import KIND_NAMES, ValueKind, damaged

_INT32, _FLOAT32, _BOOL, _STRING, _ARRAY = 5, 6, 7, 8, 9
_INTEGERS = (0, 1, 2, 3, 4, 5, 10, 11)

# key -> (type, item type of an array) as llama.cpp's converter writes and its loader reads it
TOKENIZER_KINDS = {
    "tokenizer.ggml.model": (_STRING, None),
    "tokenizer.ggml.pre": (_STRING, None),
    "tokenizer.ggml.tokens": (_ARRAY, _STRING),
    "tokenizer.ggml.merges": (_ARRAY, _STRING),
    "tokenizer.ggml.scores": (_ARRAY, _FLOAT32),
    "tokenizer.ggml.token_type": (_ARRAY, _INT32),
    "tokenizer.ggml.add_bos_token": (_BOOL, None),
    "tokenizer.ggml.add_eos_token": (_BOOL, None),
    "tokenizer.chat_template": (_STRING, None),
    "general.architecture": (_STRING, None),
}
# per-token arrays: one item for each of tokenizer.ggml.tokens
_PER_TOKEN = ("tokenizer.ggml.scores", "tokenizer.ggml.token_type")
SPECIAL_ID = re.compile(r"tokenizer\.ggml\.\w+_token_id$")


def check_metadata(path, metadata, kinds):
    """Raise :class:`~redcoast.errors.ConfigError` (:func:`damaged`) at the first metadata value
    of a known key stored as another type, a per-token array of another length than the
    vocabulary, or a special token id outside it."""
    for key, (kind, item_kind) in TOKENIZER_KINDS.items():
        if key in kinds and (kinds[key].kind, kinds[key].item_kind) != (kind, item_kind):
            raise damaged(path, f"{key!r} is {_kind_name(kinds[key])}, GGUF's tokenizers store "
                          f"{_kind_name(ValueKind(kind, item_kind))} there",
                          _where(key, kinds))
    tokens = metadata.get("tokenizer.ggml.tokens")
    for key in _PER_TOKEN:
        if tokens is not None and key in metadata and len(metadata[key]) != len(tokens):
            raise damaged(path, f"{key!r} has {len(metadata[key])} items for "
                          f"{len(tokens)} tokens", _where(key, kinds))
    for key, value in metadata.items():
        if not SPECIAL_ID.match(key):
            continue
        if kinds[key].kind not in _INTEGERS:
            raise damaged(path, f"the special token id {key!r} is "
                          f"{_kind_name(kinds[key])}, not an integer", _where(key, kinds))
        if tokens is not None and not 0 <= value < len(tokens):
            raise damaged(path, f"the special token id {key!r} is {value}, outside the "
                          f"vocabulary of {len(tokens)} tokens (ids 0 to {len(tokens) - 1})",
                          _where(key, kinds))


def _kind_name(kind):
    name = KIND_NAMES.get(kind.kind, f"type {kind.kind}")
    return f"an array of {KIND_NAMES.get(kind.item_kind)}" if kind.kind == _ARRAY else f"a {name}"


def _where(key, kinds):
    return f"metadata value {key!r} at byte {kinds[key].offset}"
