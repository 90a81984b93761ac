"""Completions sampled from a model's parameters where they are: the rollouts of reinforcement
learning (GRPO, PPO on text) and generation-based evaluation during training.

:class:`Sampler` runs :func:`redcoast.models.generate` inside a :class:`redcoast.Predictor`'s
compiled step, so a Trainer's parameters (``trainer.params``, laid out over the model and data
shards) are used in place: prompts are split over the data shards, the weights stay split over
the model shards, nothing is copied to the host but the new tokens.
"""

import numpy as np

from .. import validate
from ..errors import ConfigError, DataError
from ..models.generate import check_token_ids, generate, left_pad, split_completions
from ..models.search_parts import model_defaults
from ..predictor import Predictor
from .logprobs import token_logprobs

#: pure sampling from the model's distribution at ``temperature`` (no top-k or top-p cut): what
#: a policy-gradient objective's log-probabilities assume
SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


class Sampler:
    """Samples ``n`` completions per prompt with ``generate(model, ...)`` in one compiled step.

    ``options`` are ``generate``'s (``temperature``, ``top_k``, ``do_sample=False`` for
    greedy, ``eos_token_id``, ``pad_token_id``, ...) over :data:`SAMPLING`; :meth:`logprobs`
    scores given tokens under the same distribution (the "old" policy of a clipped objective).
    Prompts (token-id lists) are left-padded to ``prompt_len`` tokens, one width and so one
    compilation; without it, to the longest prompt of each call rounded up to a multiple of 32.

    With ``lora``, :meth:`sample`'s ``params`` are the adapters and ``frozen_params`` the base,
    merged inside the step (as a LoRA loss does): the Trainer's two trees as they are.
    """

    def __init__(self, deployer, model, *, max_new_tokens, prompt_len=None, lora=None,
                 **options):
        if "rng" in options or "stop_strings" in options:
            raise ConfigError("Sampler takes rng in sample(..., rng=key), and cannot apply "
                              "stop_strings inside its compiled step. Fix: pass rng to sample; "
                              "for stop strings use stop_sequences (token ids).")
        self.model, self.lora, self.prompt_len = model, lora, prompt_len
        self.eos_token_id, self.pad_token_id = model_defaults(
            model, options.pop("eos_token_id", None), options.pop("pad_token_id", None))
        self.options = {**SAMPLING, **options, "max_new_tokens": max_new_tokens,
                        "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id}
        self._sampler = Predictor(deployer, _stack, self._sample_fn)
        self._scorer = Predictor(deployer, _stack, self._logprobs_fn)

    def _policy(self, weights):
        if self.lora is None:
            return weights["params"]
        return self.lora.merge(weights["frozen_params"], weights["params"])

    def _sample_fn(self, rng, weights, batch):
        return generate(self.model, self._policy(weights), batch["input_ids"],
                        batch["attention_mask"], rng=rng, **self.options)

    def _logprobs_fn(self, rng, weights, batch):
        logits = self.model.apply(self._policy(weights), batch["input_ids"],
                                  segment_ids=batch["segment_ids"])
        return token_logprobs(logits / self.options["temperature"], batch["targets"])

    def _weights(self, params, frozen_params):
        if self.lora is not None and frozen_params is None:
            raise ConfigError("This Sampler has lora=..., so it needs the base as frozen_params "
                              "(the Trainer's trainer.frozen_params) and the adapters as params.")
        if self.lora is None and frozen_params is not None:
            raise ConfigError("frozen_params given, but this Sampler has no lora to merge them "
                              "with. Fix: Sampler(..., lora=lora), or pass the model's "
                              "parameters as params alone.")
        validate.array_leaves("params", params)
        validate.array_leaves("frozen_params", frozen_params)
        return {"params": params, **({} if frozen_params is None else
                                     {"frozen_params": frozen_params})}

    def sample(self, prompts, params, per_device_batch_size, *, n=1, frozen_params=None,
               rng=None):
        """``len(prompts) * n`` completions, each prompt's ``n`` together, in prompt order: each
        a list of new token ids up to and including its first EOS (the whole
        ``max_new_tokens`` where none came).

        ``rng`` fixes the samples; without it each call draws a fresh key from the deployer."""
        weights = self._weights(params, frozen_params)
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"n={n!r}: the completions per prompt must be a positive integer.")
        prompts = [_prompt_ids(p) for p in prompts for _ in range(n)]
        if not prompts:
            return []
        width = self.prompt_len or -(-max(len(p) for p in prompts) // 32) * 32
        if max(len(p) for p in prompts) > width:
            raise DataError(f"a prompt has {max(len(p) for p in prompts)} tokens, more than "
                            f"prompt_len={width}. Fix: Sampler(..., prompt_len=...) at least the "
                            "longest prompt, or shorten the prompts.")
        rows = [dict(zip(("input_ids", "attention_mask"),
                         left_pad([p], self.pad_token_id, width))) for p in prompts]
        check_token_ids(np.concatenate([r["input_ids"] for r in rows]), self.model)
        tokens = self._sampler.predict(rows, per_device_batch_size, weights, rng=rng)
        return split_completions(np.stack(tokens), self.eos_token_id)

    def logprobs(self, rows, params, per_device_batch_size, *, frozen_params=None):
        """Each row's ``[seq_len]`` log-probabilities of its ``targets`` under the distribution
        :meth:`sample` draws from (the logits over ``temperature``): the sampling policy's,
        which PPO's and GRPO's ratios hold fixed. ``rows`` are token rows as
        :func:`redcoast.text.packing.pad_sequences` makes them (``input_ids``, ``targets``,
        ``segment_ids``), for a model that takes ``segment_ids`` (Llama, OPT)."""
        weights = self._weights(params, frozen_params)
        fields = ("input_ids", "targets", "segment_ids")
        rows = [{k: np.asarray(r[k])[None] for k in fields} for r in rows]
        return self._scorer.predict(rows, per_device_batch_size, weights)


def _prompt_ids(prompt):
    """A prompt as a list of token ids, or the error a text or a tokenizer's output deserves."""
    if isinstance(prompt, str) or hasattr(prompt, "ids"):
        raise DataError(f"a prompt is {type(prompt).__name__}, not a list of token ids. Fix: "
                        "tokenizer.encode(text).ids for each prompt.")
    ids = list(prompt)
    if not ids:
        raise DataError("a prompt has no tokens. Fix: start every prompt with at least one "
                        "token (e.g. BOS, or the chat template's start).")
    odd = [t for t in ids if not isinstance(t, (int, np.integer))]
    if odd:
        raise DataError(f"a prompt holds {type(odd[0]).__name__} values ({odd[0]!r}), not "
                        "integer token ids. Fix: pass each prompt's token ids.")
    return ids


def _stack(rows):
    return {key: np.concatenate([r[key] for r in rows]) for key in rows[0]}
