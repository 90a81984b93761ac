"""What every search shares (greedy, sampling, beam search; decoder-only and encoder-decoder):
its options, resolved as transformers' ``generate`` resolves them (a call's value, else the
model's generation_config.json, else transformers' default) and checked once, and the small
pieces each loop uses on the scores (filters, EOS test, per-row random keys)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import ConfigError

NEG = -1.0e9  # the score of a hypothesis that must not be chosen (finite, so sums stay finite)


# transformers' defaults for what generation_config.json may set (GenerationConfig's
# _get_default_generation_params; redco's Flax generate had the same): a call's own value wins,
# then the model's generation_config.json, then these.
SEARCH_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                   "num_beams": 1, "length_penalty": 1.0, "early_stopping": False,
                   "repetition_penalty": 1.0, "min_new_tokens": 0, "min_length": 0,
                   "no_repeat_ngram_size": 0, "forced_bos_token_id": None,
                   "forced_eos_token_id": None}


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """How tokens are chosen; hashable, so each setting is compiled once.

    Build it with :meth:`make`, which checks every value (defaults: :func:`search_options`)."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    num_beams: int
    length_penalty: float
    early_stopping: object  # True, False or "never", as in transformers
    eos_token_id: tuple
    pad_token_id: int
    repetition_penalty: float
    min_new_tokens: int
    no_repeat_ngram_size: int
    forced_bos_token_id: int | None
    forced_eos_token_id: tuple
    stop_sequences: tuple  # of token-id tuples

    @classmethod
    def make(cls, *, max_new_tokens, do_sample, temperature, top_k, top_p, num_beams,
             length_penalty, early_stopping, eos_token_id, pad_token_id, repetition_penalty,
             min_new_tokens, no_repeat_ngram_size, forced_bos_token_id, forced_eos_token_id,
             stop_sequences):
        """Every option given: a call's completed by :func:`search_options`."""
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens!r}; it must be a positive integer.")
        if not isinstance(num_beams, (int, np.integer)) or num_beams < 1:
            raise ConfigError(f"num_beams={num_beams!r}; it must be a positive integer "
                              "(1 = no beams).")
        if do_sample and not temperature > 0:
            raise ConfigError(f"temperature={temperature!r} with do_sample=True; it must be > 0 "
                              "(for the most likely token use do_sample=False).")
        if not isinstance(top_k, (int, np.integer)) or top_k < 0:
            raise ConfigError(f"top_k={top_k!r}; it must be an integer >= 0 (0 = no top-k filter).")
        if not 0 < top_p <= 1:
            raise ConfigError(f"top_p={top_p!r}; it must be in (0, 1] (1 = no nucleus filter).")
        if early_stopping not in (True, False, "never"):
            raise ConfigError(f"early_stopping={early_stopping!r}; use True, False or 'never'.")
        if not repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty={repetition_penalty!r}; it must be > 0 (1.0 = "
                              "off, above 1 discourages repeating tokens).")
        for name, value in (("min_new_tokens", min_new_tokens),
                            ("no_repeat_ngram_size", no_repeat_ngram_size)):
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise ConfigError(f"{name}={value!r}; it must be an integer >= 0 (0 = off).")
        if min_new_tokens and min_new_tokens > max_new_tokens:
            raise ConfigError(f"min_new_tokens={min_new_tokens} is more than max_new_tokens="
                              f"{max_new_tokens}. Fix: raise max_new_tokens or lower "
                              "min_new_tokens.")
        stops = tuple(_id_tuple(seq, "stop_sequences") for seq in stop_sequences)
        if any(len(seq) == 0 for seq in stops):
            raise ConfigError("stop_sequences has an empty sequence; each must hold token ids "
                              "(for text, use stop_strings with a tokenizer).")
        cfg = cls(int(max_new_tokens), bool(do_sample), float(temperature), int(top_k),
                  float(top_p), int(num_beams), float(length_penalty), early_stopping,
                  _id_tuple(eos_token_id, "eos_token_id"), int(pad_token_id),
                  float(repetition_penalty), int(min_new_tokens), int(no_repeat_ngram_size),
                  None if forced_bos_token_id is None else int(forced_bos_token_id),
                  _id_tuple(forced_eos_token_id, "forced_eos_token_id"), stops)
        if cfg.num_beams > 1 and cfg.stop_sequences:
            raise ConfigError("stop_sequences work with greedy decoding and sampling, not yet "
                              "with beam search. Fix: use num_beams=1 with them, or give the "
                              "sequences' last tokens as eos_token_id.")
        return cfg


def _id_tuple(value, name):
    """``None``, one id or a list of ids, as a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, (int, np.integer)):
        return (int(value),)
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r}; give a token id or a list of token ids.") from None


def search_options(model, given, rng):
    """``given`` (a call's search options, None where not passed) completed from the model's
    generation_config.json, then :data:`SEARCH_DEFAULTS`, as transformers' ``generate`` does.
    Sampling asked for by the file alone needs ``rng``: without one, an error says so."""
    from_file = getattr(model, "generation_config", None) or {}
    options = {}
    for name, default in SEARCH_DEFAULTS.items():
        value = given.get(name)
        if value is None:
            value = from_file.get(name)
        options[name] = default if value is None else value
    if options["do_sample"] and given.get("do_sample") is None and rng is None:
        raise ConfigError(
            "the model's generation_config.json asks for sampling (do_sample=True, temperature "
            f"{options['temperature']}, top_k {options['top_k']}, top_p {options['top_p']}), as "
            "transformers' generate would do. Fix: pass rng=jax.random.key(seed) to sample so, or "
            "do_sample=False for greedy decoding.")
    return options


def search_config(model, given, *, max_new_tokens, eos_token_id, pad_token_id, stop_sequences,
                  rng, context_width):
    """The checked :class:`SearchConfig` of one call: ``given`` (its search options, None where
    not passed) completed by :func:`search_options`, EOS and pad by :func:`model_defaults`.

    ``min_length`` counts the whole history, as transformers counts it: the ``context_width``
    tokens before the new ones (a decoder's padded prompt, an encoder-decoder's start token)
    and the new ones; it becomes the equivalent ``min_new_tokens``. ``min_new_tokens``, where
    the call or the file sets it, wins over ``min_length`` (as in transformers)."""
    eos, pad = model_defaults(model, eos_token_id, pad_token_id)
    options = search_options(model, given, rng)
    min_length = options.pop("min_length")
    if not isinstance(min_length, (int, np.integer)) or min_length < 0:
        raise ConfigError(f"min_length={min_length!r}; it must be an integer >= 0 (0 = off).")
    from_file = getattr(model, "generation_config", None) or {}
    if given.get("min_new_tokens") is None and from_file.get("min_new_tokens") is None:
        min_new = max(int(min_length) - context_width, 0)
        if given.get("min_length") is not None and min_new > max_new_tokens:
            raise ConfigError(
                f"min_length={min_length} is more than the {context_width} tokens before the new "
                f"ones plus max_new_tokens={max_new_tokens}. Fix: raise max_new_tokens to at least "
                f"{min_new} or lower min_length.")
        # a file's min_length beyond reach forbids EOS at every step, as in transformers
        options["min_new_tokens"] = min(min_new, max_new_tokens)
    return SearchConfig.make(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                             stop_sequences=stop_sequences, **options)


def model_defaults(model, eos_token_id, pad_token_id):
    """``(eos, pad)`` as transformers chooses them: given, else the model's generation config or
    config (``generation_config.json``, a GGUF file's tokenizer metadata); pad falls back to the
    first EOS, then 0. ``eos_token_id=()`` asks for no EOS at all."""
    sources = [getattr(model, "generation_config", None) or {}, model.config]

    def default(name):
        for source in sources:
            value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
            if value is not None:
                return value
        return None
    eos = default("eos_token_id") if eos_token_id is None else eos_token_id
    eos = _id_tuple(eos, "eos_token_id")
    if pad_token_id is None:
        pad_token_id = default("pad_token_id")
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    return eos, int(pad_token_id)


# ---------------------------------------------------------------------------- logits filters

def top_k_filter(logits, k):
    """``logits`` with everything below the k-th largest value of each row set to -inf (ties
    kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def top_p_filter(logits, p):
    """Nucleus filter: keep the most likely tokens whose probabilities sum to at least ``p``
    (always at least one); the rest become -inf."""
    if p >= 1.0:
        return logits
    ordered = -jnp.sort(-logits, axis=-1)  # descending
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above each one
    n_keep = jnp.sum(before < p, axis=-1, keepdims=True)  # >= 1: the first token has 0 before it
    threshold = jnp.take_along_axis(ordered, n_keep - 1, axis=-1)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def warp(logits, cfg):
    """Temperature, then top-k, then top-p (transformers' order)."""
    if cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    return top_p_filter(top_k_filter(logits, cfg.top_k), cfg.top_p)


def is_eos(tokens, cfg):
    hit = jnp.zeros(tokens.shape, bool)
    for e in cfg.eos_token_id:
        hit = hit | (tokens == e)
    return hit


def row_keys(rng, n_rows):
    """One key per row, each independent of the batch size (row r gets fold_in(rng, r))."""
    return jax.vmap(lambda r: jax.random.fold_in(rng, r))(jnp.arange(n_rows))


def last_logits(logits):
    """[N, V] logits of the last position ([N, 1, V] or [N, V] given)."""
    return logits[:, -1] if logits.ndim == 3 else logits
