"""Log-probabilities of given tokens under a model's logits: what preference and reinforcement
objectives (DPO, ORPO, GRPO, ...) compare between a policy and a reference.

Both take the logits of a causal LM and the tokens each position predicts (``targets``: the
next token, as :func:`redcoast.text.packing.pack_sequences` and ``pad_sequences`` give them), in
float32 whatever the logits' dtype.
"""

import jax.numpy as jnp
import optax


def token_logprobs(logits, targets):
    """``log p(targets[b, t] | ...)`` for each position: ``[batch, seq]`` float32."""
    return -optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def sequence_logprobs(logits, targets, mask):
    """The log-probability of each row's masked tokens together (e.g. a completion after its
    prompt): ``[batch]``, the sum of :func:`token_logprobs` where ``mask`` is 1."""
    return jnp.sum(token_logprobs(logits, targets) * mask, axis=-1)
