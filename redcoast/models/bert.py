"""BERT (encoder + pooler) and BERT for sequence classification, with Hugging Face weights.

Post-LayerNorm encoder: absolute position and token-type embeddings, bidirectional attention over
the real (mask = 1) tokens, a tanh pooler on the first token. ``mean_pool`` gives the sentence
embeddings of sentence-transformers models such as all-MiniLM-L6-v2.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import ConfigError
from . import hf, stacked
from .activations import activation
from .layers import attend

# run settings, not the model's
_NOT_IN_HF = ("dtype", "remat", "scan_layers", "attention_implementation")


@dataclass(frozen=True)
class Config:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    labels: tuple = ("LABEL_0", "LABEL_1")  # class names, index = label id (classification head)
    architecture: str = "BertModel"
    dtype: Any = jnp.float32
    remat: bool = False
    scan_layers: bool = False  # the layers stacked and run by a scan (models/stacked.py)
    attention_implementation: Any = None  # None: per call (models/attention.py)

    def __post_init__(self):
        activation(self.hidden_act, "hidden_act")  # fail early if unknown
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not a multiple of "
                              f"num_attention_heads {self.num_attention_heads}.")

    @property
    def num_labels(self):
        return len(self.labels)

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, d):
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError(f"position_embedding_type {d['position_embedding_type']!r} is not "
                              "supported; redcoast's BERT has absolute position embeddings only.")
        if d.get("is_decoder") or d.get("add_cross_attention"):
            raise ConfigError("BERT as a decoder (is_decoder / add_cross_attention) is not "
                              "supported; redcoast's BERT is an encoder.")
        id2label = d.get("id2label") or {}
        if id2label:
            labels = tuple(id2label[k] for k in sorted(id2label, key=int))
        else:
            labels = tuple(f"LABEL_{i}" for i in range(d.get("num_labels", 2)))
        names = set(f.name for f in dataclasses.fields(cls)) - {"labels", "architecture",
                                                                  *_NOT_IN_HF}
        return cls(**{k: d[k] for k in names if d.get(k) is not None}, labels=labels,
                   architecture=(d.get("architectures") or ["BertModel"])[0])

    def to_hf(self):
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("labels", "architecture", *_NOT_IN_HF)}
        return {**d, "model_type": "bert", "architectures": [self.architecture],
                "position_embedding_type": "absolute",
                "id2label": {str(i): name for i, name in enumerate(self.labels)},
                "label2id": {name: i for i, name in enumerate(self.labels)}}


def _linear(n_in, n_out, config, param_dtype, rngs):
    return nnx.Linear(n_in, n_out, dtype=config.dtype, param_dtype=param_dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02))


def _layer_norm(config, param_dtype, rngs):
    # Two-pass variance: E[x^2] - E[x]^2 loses digits the reference keeps.
    return nnx.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps, dtype=config.dtype,
                         param_dtype=param_dtype, use_fast_variance=False, rngs=rngs)


def _embed(n, config, param_dtype, rngs):
    return nnx.Embed(n, config.hidden_size, dtype=config.dtype, param_dtype=param_dtype, rngs=rngs,
                     embedding_init=nnx.initializers.normal(0.02))


class BertLayer(nnx.Module):
    """Self-attention then feed-forward, each followed by residual + LayerNorm (post-LN)."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        self.config = config
        h, f = config.hidden_size, config.intermediate_size
        self.query = _linear(h, h, config, param_dtype, rngs)
        self.key = _linear(h, h, config, param_dtype, rngs)
        self.value = _linear(h, h, config, param_dtype, rngs)
        self.attn_out = _linear(h, h, config, param_dtype, rngs)
        self.attn_norm = _layer_norm(config, param_dtype, rngs)
        self.ffn_in = _linear(h, f, config, param_dtype, rngs)
        self.ffn_out = _linear(f, h, config, param_dtype, rngs)
        self.ffn_norm = _layer_norm(config, param_dtype, rngs)

    def __call__(self, x, mask):
        b, t, _ = x.shape
        heads = lambda y: y.reshape(b, t, self.config.num_attention_heads, self.config.head_dim)  # noqa: E731
        a = attend(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)), mask,
                   implementation=self.config.attention_implementation)
        x = self.attn_norm(x + self.attn_out(a.reshape(b, t, -1)))
        h = self.ffn_out(activation(self.config.hidden_act)(self.ffn_in(x)))
        return self.ffn_norm(x + h)


class BertModel(nnx.Module):
    """``(input_ids, attention_mask=None, token_type_ids=None) -> (last_hidden_state, pooled)``,
    both float32; ``attention_mask`` [B, T] is 1 for real tokens, 0 for padding."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        self.config = config
        self.word_embeddings = _embed(config.vocab_size, config, param_dtype, rngs)
        self.position_embeddings = _embed(config.max_position_embeddings, config, param_dtype, rngs)
        self.token_type_embeddings = _embed(config.type_vocab_size, config, param_dtype, rngs)
        self.embed_norm = _layer_norm(config, param_dtype, rngs)
        self.layers = stacked.make_layers(
            lambda i, r: BertLayer(config, rngs=r, param_dtype=param_dtype),
            config.num_hidden_layers, rngs, config.scan_layers)
        self.pooler = _linear(config.hidden_size, config.hidden_size, config, param_dtype, rngs)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None):
        t = input_ids.shape[1]
        if t > self.config.max_position_embeddings:
            raise ConfigError(f"{t} tokens exceed max_position_embeddings="
                              f"{self.config.max_position_embeddings}; truncate the inputs.")
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
             + self.position_embeddings(jnp.arange(t))[None])
        x = self.embed_norm(x)
        # A key mask: every query attends to the real tokens of its row.
        mask = None if attention_mask is None else attention_mask.astype(bool)[:, None, None, :]
        x, _ = stacked.run_layers(self.layers, self.config.num_hidden_layers, x, None,
                                  lambda layer, h, _: (layer(h, mask), None),
                                  scanned=self.config.scan_layers, remat=self.config.remat)
        pooled = jnp.tanh(self.pooler(x[:, 0]))
        return x.astype(jnp.float32), pooled.astype(jnp.float32)


class BertForSequenceClassification(nnx.Module):
    """``(input_ids, attention_mask=None, token_type_ids=None) -> logits`` [B, num_labels], from a
    linear head on the pooled output."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        self.config = config
        self.bert = BertModel(config, rngs=rngs, param_dtype=param_dtype)
        self.classifier = _linear(config.hidden_size, config.num_labels, config, param_dtype, rngs)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None):
        _, pooled = self.bert(input_ids, attention_mask, token_type_ids)
        return self.classifier(pooled.astype(self.config.dtype)).astype(jnp.float32)


def mean_pool(hidden, mask):
    """The average of ``hidden`` [B, T, D] over the tokens where ``mask`` [B, T] is 1."""
    mask = mask.astype(hidden.dtype)[..., None]
    return (hidden * mask).sum(1) / jnp.maximum(mask.sum(1), 1e-9)


MODULES = {"BertModel": BertModel, "BertForSequenceClassification": BertForSequenceClassification}
DEFAULT_MODULE = BertModel
# A BertModel checkpoint (e.g. all-MiniLM-L6-v2) loads as a classifier with a fresh head.
TASK_HEADS = {BertForSequenceClassification: ("classifier",)}
UNUSED_OK = (r"position_ids$",)  # a buffer of transformers' embeddings, not a weight


def hf_sources(config, module_cls):
    """Tensor names as transformers saves them: BertModel without a prefix, the classifier's
    encoder under "bert."; either spelling is read."""
    prefix, other = ("", "bert.") if module_cls is BertModel else ("bert.", "")

    def src(name, transpose=False):
        return hf.Source(prefix + name, transpose, aliases=(other + name,))

    def linear(name):
        return {"kernel": src(f"{name}.weight", transpose=True), "bias": src(f"{name}.bias")}

    def norm(name):
        return {"scale": src(f"{name}.weight"), "bias": src(f"{name}.bias")}

    def layer(i):
        p = f"encoder.layer.{i}."
        return {"query": linear(p + "attention.self.query"), "key": linear(p + "attention.self.key"),
                "value": linear(p + "attention.self.value"),
                "attn_out": linear(p + "attention.output.dense"),
                "attn_norm": norm(p + "attention.output.LayerNorm"),
                "ffn_in": linear(p + "intermediate.dense"), "ffn_out": linear(p + "output.dense"),
                "ffn_norm": norm(p + "output.LayerNorm")}

    encoder = {
        "word_embeddings": {"embedding": src("embeddings.word_embeddings.weight")},
        "position_embeddings": {"embedding": src("embeddings.position_embeddings.weight")},
        "token_type_embeddings": {"embedding": src("embeddings.token_type_embeddings.weight")},
        "embed_norm": norm("embeddings.LayerNorm"),
        "layers": stacked.layer_sources(layer, config.num_hidden_layers, config.scan_layers),
        "pooler": linear("pooler.dense"),
    }
    if module_cls is BertModel:
        return encoder
    head = {"kernel": hf.Source("classifier.weight", True), "bias": hf.Source("classifier.bias")}
    return {"bert": encoder, "classifier": head}


def example_inputs(config, module_cls):
    t = min(8, config.max_position_embeddings)
    ids = jax.ShapeDtypeStruct((2, t), jnp.int32)
    return ids, ids  # input_ids, attention_mask
