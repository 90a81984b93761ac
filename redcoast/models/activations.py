"""The activation functions Hugging Face configs name (``hidden_act``, ``activation_function``,
T5's ``feed_forward_proj``), one table for every family in redcoast.models."""

from functools import partial

import jax

from ..errors import ConfigError

ACTIVATIONS = {
    "gelu": partial(jax.nn.gelu, approximate=False),  # the erf form (BERT, BART, ViT)
    "gelu_new": partial(jax.nn.gelu, approximate=True),  # the tanh approximation (GPT-2, GPT-J)
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jax.numpy.tanh,  # ViT's pooler
}


def activation(name, field="activation"):
    """The function called ``name``, or a ConfigError naming ``field`` and the supported names."""
    if name not in ACTIVATIONS:
        raise ConfigError(f"{field}={name!r} is not supported; use one of {sorted(ACTIVATIONS)} "
                          "(or add it to redcoast/models/activations.py).")
    return ACTIVATIONS[name]
