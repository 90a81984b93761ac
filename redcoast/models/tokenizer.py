"""Tokenizers rebuilt from GGUF metadata, and the ChatML chat format (SmolLM2, Qwen, ...).

A GGUF file of a byte-level BPE model (``tokenizer.ggml.model == "gpt2"``) carries the whole
tokenizer: the tokens (their ids are their positions), the merges in priority order, each
token's type (control tokens such as ``<|im_start|>`` are special) and the name of the
pre-tokenizer (``tokenizer.ggml.pre``), which decides how text is split before BPE. That is
enough to rebuild a ``tokenizers.Tokenizer`` without the original tokenizer.json.
"""

from ..errors import ConfigError

# llama.cpp token types (gguf.TokenType): 3 control (special: dropped by skip_special_tokens),
# 4 user-defined (e.g. <think>: kept in decoded text); both are matched whole, as transformers
# and llama.cpp match them
_CONTROL, _USER_DEFINED = 3, 4

# GPT-2's split (contractions, letters, numbers, other symbols, spaces), after digits are split
# one by one: llama.cpp uses it for "smollm", "starcoder", "refact" and a few others.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone",
                     "minerva")
_GPT2 = ("gpt2", "default", "gpt-2")

# The split of the model's own tokenizer.json (a regex, then byte-level BPE without GPT-2's
# split), for the names llama.cpp gives it: Llama 3 (numbers in runs of up to 3 digits) and
# Qwen2 (digits one by one).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "stablelm2": _QWEN2_SPLIT}


def _tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise ConfigError("rebuilding a GGUF file's tokenizer needs the `tokenizers` package: "
                          "pip install tokenizers (or from_gguf(..., with_tokenizer=False))") from e
    return tokenizers


def _pre_tokenizer(name):
    pre = _tokenizers().pre_tokenizers
    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _GPT2:
        return byte_level
    if name in _DIGITS_THEN_GPT2:
        return pre.Sequence([pre.Digits(individual_digits=True), byte_level])
    if name in _SPLITS:
        split = pre.Split(_tokenizers().Regex(_SPLITS[name]), behavior="isolated", invert=False)
        return pre.Sequence([split, pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    supported = sorted(_GPT2 + _DIGITS_THEN_GPT2 + tuple(_SPLITS))
    raise ConfigError(f"GGUF pre-tokenizer {name!r} is not supported (redcoast rebuilds "
                      f"{supported}); load the tokenizer from the model's "
                      "tokenizer.json with tokenizers.Tokenizer.from_file instead, and pass "
                      "with_tokenizer=False to from_gguf.")


def build_tokenizer(tokens, merges, token_types=None, pre="gpt2"):
    """A byte-level BPE ``tokenizers.Tokenizer`` from GGUF-style lists.

    ``tokens``: the vocabulary (id = position); ``merges``: "left right" strings, highest
    priority first; ``token_types``: llama.cpp token types (control and user-defined tokens
    are matched whole, control ones special); ``pre``: the ``tokenizer.ggml.pre`` name.
    """
    tk = _tokenizers()
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tokenizer = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = tk.decoders.ByteLevel()
    _add_whole_tokens(tokenizer, tokens, token_types)
    return tokenizer


def _add_whole_tokens(tokenizer, tokens, token_types):
    """Control and user-defined tokens matched whole in the text (control ones special)."""
    tk = _tokenizers()
    kinds = [int(k) for k in token_types] if token_types is not None else []
    for kind, special in ((_CONTROL, True), (_USER_DEFINED, False)):
        whole = [tk.AddedToken(tokens[i], special=special, normalized=False)
                 for i, k in enumerate(kinds) if k == kind]
        if whole:
            (tokenizer.add_special_tokens if special else tokenizer.add_tokens)(whole)


def build_sentencepiece_tokenizer(tokens, scores, token_types=None):
    """A SentencePiece BPE ``tokenizers.Tokenizer`` (llama.cpp's "llama" tokenizer model: Llama
    2, Mistral, TinyLlama) from GGUF-style lists, as transformers rebuilds one: the merges
    recovered from the pieces' scores, "▁" for each space and one before the text, bytes
    outside the vocabulary as their ``<0xNN>`` pieces."""
    tk = _tokenizers()
    vocab = {token: i for i, token in enumerate(tokens)}
    kinds = [int(k) for k in token_types] if token_types is not None else []
    unknown = next((tokens[i] for i, kind in enumerate(kinds) if kind == 2), None)
    tokenizer = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=_merges_by_score(tokens, scores),
                                           unk_token=unknown, fuse_unk=True, byte_fallback=True))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement="▁",
                                                          prepend_scheme="first", split=False)
    d = tk.decoders
    tokenizer.decoder = d.Sequence([d.Replace("▁", " "), d.ByteFallback(), d.Fuse(),
                                    d.Strip(content=" ", left=1, right=0)])
    _add_whole_tokens(tokenizer, tokens, token_types)
    return tokenizer


def _merges_by_score(tokens, scores):
    """BPE merges of a SentencePiece vocabulary: every split of a piece into two pieces, the
    higher the whole piece's score the earlier (then the longer left part, the longer right).
    A piece listed twice counts once, at its last place and score (as transformers reads it)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for piece, score in dict(zip(tokens, scores)).items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece))
                  if piece[:i] in vocab and piece[i:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges += [(left, right, float(score)) for left, right in splits]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def tokenizer_from_gguf(file):
    """The tokenizer of a :class:`redcoast.models.gguf.GGUFFile`: byte-level BPE ("gpt2")
    or SentencePiece BPE ("llama")."""
    kind = file.get("tokenizer.ggml.model")
    tokens = file.require("tokenizer.ggml.tokens")
    if kind == "gpt2":
        tokenizer = build_tokenizer(tokens, file.require("tokenizer.ggml.merges"),
                                    file.get("tokenizer.ggml.token_type"),
                                    file.get("tokenizer.ggml.pre", "gpt2"))
    elif kind == "llama":
        tokenizer = build_sentencepiece_tokenizer(tokens, file.require("tokenizer.ggml.scores"),
                                                  file.get("tokenizer.ggml.token_type"))
    else:
        raise ConfigError(f"GGUF tokenizer model {kind!r} is not supported; redcoast rebuilds "
                          "byte-level BPE ('gpt2') and SentencePiece BPE ('llama') tokenizers. "
                          "Load the tokenizer from the model's tokenizer.json with "
                          "tokenizers.Tokenizer.from_file, and pass with_tokenizer=False to "
                          "from_gguf.")
    # a SentencePiece file that does not say adds BOS (llama.cpp's default, and transformers')
    adds = {"bos": kind == "llama", "eos": False}
    added = {end: tokens[file.get(f"tokenizer.ggml.{end}_token_id")] for end in ("bos", "eos")
             if file.get(f"tokenizer.ggml.add_{end}_token", adds[end])
             and file.get(f"tokenizer.ggml.{end}_token_id") is not None}
    if added:
        tokenizer.post_processor = _adding(added, tokenizer)
    return tokenizer


def _adding(added, tokenizer):
    """A post-processor that puts the file's BOS before and EOS after each text, as llama.cpp
    and transformers do where the file says ``add_bos_token`` / ``add_eos_token`` (Llama 3):
    ``encode(text)`` adds them, ``encode(text, add_special_tokens=False)`` (a chat template's
    text, which writes them itself) does not."""
    def around(part, index):
        pieces = [added.get("bos"), f"${part}", added.get("eos")]
        return " ".join(f"{piece}:{index}" for piece in pieces if piece is not None)
    return _tokenizers().processors.TemplateProcessing(
        single=around("A", 0), pair=f"{around('A', 0)} {around('B', 1)}",
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in added.values()])


SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def apply_chat_template(messages, add_generation_prompt=True, default_system=SMOLLM2_SYSTEM,
                        template=None, **variables):
    """Messages ([{"role": ..., "content": ...}]) as a prompt string: rendered by ``template``
    (a model's own :class:`~redcoast.models.chat_template.ChatTemplate`, e.g.
    ``model.chat_template``; ``variables`` such as ``tools`` go to it) where one is given, else
    in ChatML, the fallback for a model without a template.

    In ChatML each message is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; the generation prompt
    ``<|im_start|>assistant\\n`` follows. Like SmolLM2's own template, a conversation that does
    not start with a system message gets ``default_system`` first (None: no system message).
    """
    if template is not None:
        return template.render(messages, add_generation_prompt=add_generation_prompt, **variables)
    if variables:
        raise ConfigError(f"apply_chat_template got {sorted(variables)}, which only a model's own "
                          "template takes. Fix: pass template=model.chat_template.")
    parts = []
    if messages and messages[0]["role"] != "system" and default_system is not None:
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for message in messages:
        parts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
