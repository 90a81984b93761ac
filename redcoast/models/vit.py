"""ViT (google/vit-base-patch16-224, ...) as a Flax NNX image encoder with Hugging Face weights:
patch embedding, class token, learned positions, pre-LN layers, a final LayerNorm and the
optional tanh pooler on the class token.

Images come as ``pixel_values [B, channels, height, width]`` (the layout of transformers' image
processors) at the configured ``image_size`` (no position interpolation). The patch embedding
keeps PyTorch's convolution kernel (hidden, channels, patch, patch) as it is stored: a stride-
``patch`` convolution is one matmul over each patch, written as an einsum.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import ConfigError, DataError
from . import hf, stacked
from .activations import activation
from .blocks import dense, layer_norm, merge_heads, split_heads
from .layers import attend

# Config fields not in config.json: how redcoast runs the model, and whether it has a pooler
_NOT_IN_HF = ("dtype", "remat", "scan_layers", "add_pooling_layer")


@dataclasses.dataclass(frozen=True)
class Config:
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    qkv_bias: bool = True
    pooler_output_size: int | None = None  # None: hidden_size
    pooler_act: str = "tanh"
    add_pooling_layer: bool = True  # not in config.json: whether the folder has a pooler
    initializer_range: float = 0.02
    dtype: Any = jnp.float32
    remat: bool = False
    scan_layers: bool = False  # the layers stacked and run by a scan (models/stacked.py)

    def __post_init__(self):
        if self.pooler_output_size is None:
            object.__setattr__(self, "pooler_output_size", self.hidden_size)
        activation(self.hidden_act, "hidden_act")
        activation(self.pooler_act, "pooler_act")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not a multiple of "
                              f"num_attention_heads {self.num_attention_heads}.")
        if self.image_size % self.patch_size:
            raise ConfigError(f"image_size {self.image_size} is not a multiple of patch_size "
                              f"{self.patch_size}.")

    @property
    def num_patches(self):
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, d):
        for key in ("image_size", "patch_size"):
            if isinstance(d.get(key), (list, tuple)):
                if len(set(d[key])) != 1:
                    raise ConfigError(f"{key}={d[key]}: redcoast's ViT takes square images and "
                                      "patches only.")
                d = {**d, key: d[key][0]}
        names = {f.name for f in dataclasses.fields(cls)} - set(_NOT_IN_HF)
        return cls(**{k: d[k] for k in names if k in d})

    def to_hf(self):
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in _NOT_IN_HF}
        return {**d, "model_type": "vit", "architectures": ["ViTModel"],
                "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def config_for_tensors(config, reader, prefix=""):
    """``config`` with ``add_pooling_layer`` set by whether the folder stores a pooler."""
    pooled = f"{prefix}pooler.dense.weight" in reader
    return config if pooled == config.add_pooling_layer else dataclasses.replace(
        config, add_pooling_layer=pooled)


class PatchEmbedding(nnx.Module):
    """pixel_values [B, C, H, W] -> [B, patches, hidden] (row-major over the patch grid)."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.config = c
        shape = (c.hidden_size, c.num_channels, c.patch_size, c.patch_size)
        self.kernel = nnx.Param(nnx.initializers.normal(c.initializer_range)(
            rngs.params(), shape, param_dtype))
        self.bias = nnx.Param(jnp.zeros((c.hidden_size,), param_dtype))

    def __call__(self, pixel_values):
        c = self.config
        b, ch, h, w = pixel_values.shape
        if (ch, h, w) != (c.num_channels, c.image_size, c.image_size):
            raise DataError(f"pixel_values has shape {pixel_values.shape}; this ViT takes [batch, "
                            f"{c.num_channels}, {c.image_size}, {c.image_size}] (channels first, "
                            "resized by the image processor).")
        p = c.patch_size
        patches = pixel_values.astype(c.dtype).reshape(b, ch, h // p, p, w // p, p)
        x = jnp.einsum("bcipjq,dcpq->bijd", patches, self.kernel[...].astype(c.dtype))
        return x.reshape(b, -1, c.hidden_size) + self.bias[...].astype(c.dtype)


class ViTLayer(nnx.Module):
    """``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.config = c
        kw = dict(dtype=c.dtype, param_dtype=param_dtype, rngs=rngs, std=c.initializer_range)
        norm = dict(eps=c.layer_norm_eps, dtype=c.dtype, param_dtype=param_dtype, rngs=rngs)
        self.layernorm_before = layer_norm(c.hidden_size, **norm)
        self.query = dense(c.hidden_size, c.hidden_size, bias=c.qkv_bias, **kw)
        self.key = dense(c.hidden_size, c.hidden_size, bias=c.qkv_bias, **kw)
        self.value = dense(c.hidden_size, c.hidden_size, bias=c.qkv_bias, **kw)
        self.attn_out = dense(c.hidden_size, c.hidden_size, **kw)
        self.layernorm_after = layer_norm(c.hidden_size, **norm)
        self.fc_in = dense(c.hidden_size, c.intermediate_size, **kw)
        self.fc_out = dense(c.intermediate_size, c.hidden_size, **kw)

    def __call__(self, x):
        c = self.config
        h = self.layernorm_before(x)
        q, k, v = (split_heads(p(h), c.num_attention_heads)
                   for p in (self.query, self.key, self.value))
        x = x + self.attn_out(merge_heads(attend(q, k, v, None,
                                                 scale=(c.hidden_size // c.num_attention_heads) ** -0.5)))
        return x + self.fc_out(activation(c.hidden_act)(self.fc_in(self.layernorm_after(x))))


class ViTModel(nnx.Module):
    """``pixel_values [B, C, H, W]`` -> ``(last_hidden_state [B, 1 + patches, hidden],
    pooled [B, pooler_output_size] or None)``, both float32; row 0 is the class token."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.config = c
        init = nnx.initializers.normal(c.initializer_range)
        self.patch_embeddings = PatchEmbedding(c, rngs=rngs, param_dtype=param_dtype)
        self.cls_token = nnx.Param(init(rngs.params(), (1, 1, c.hidden_size), param_dtype))
        self.position_embeddings = nnx.Param(init(rngs.params(), (1, c.num_patches + 1,
                                                                  c.hidden_size), param_dtype))
        self.layers = stacked.make_layers(
            lambda i, r: ViTLayer(c, rngs=r, param_dtype=param_dtype), c.num_hidden_layers, rngs,
            c.scan_layers)
        self.layernorm = layer_norm(c.hidden_size, eps=c.layer_norm_eps, dtype=c.dtype,
                                    param_dtype=param_dtype, rngs=rngs)
        if c.add_pooling_layer:
            self.pooler = dense(c.hidden_size, c.pooler_output_size, dtype=c.dtype,
                                param_dtype=param_dtype, rngs=rngs, std=c.initializer_range)

    def __call__(self, pixel_values):
        c = self.config
        x = self.patch_embeddings(pixel_values)
        cls = jnp.broadcast_to(self.cls_token[...].astype(x.dtype), (x.shape[0], 1, x.shape[2]))
        x = jnp.concatenate([cls, x], axis=1) + self.position_embeddings[...].astype(x.dtype)
        x, _ = stacked.run_layers(self.layers, c.num_hidden_layers, x, None,
                                  lambda layer, h, _: (layer(h), None),
                                  scanned=c.scan_layers, remat=c.remat)
        x = self.layernorm(x)
        pooled = None
        if c.add_pooling_layer:
            pooled = activation(c.pooler_act)(self.pooler(x[:, 0])).astype(jnp.float32)
        return x.astype(jnp.float32), pooled


MODULES = {"ViTModel": ViTModel}
DEFAULT_MODULE = ViTModel


def hf_sources(config, module_cls=ViTModel, prefix=""):
    """Tensor names as transformers saves ViTModel (``prefix`` "encoder." inside a
    VisionEncoderDecoderModel)."""
    def src(name, transpose=False):
        return hf.Source(prefix + name, transpose)

    def linear(name):
        return {"kernel": src(f"{name}.weight", True), "bias": src(f"{name}.bias")}

    def norm(name):
        return {"scale": src(f"{name}.weight"), "bias": src(f"{name}.bias")}

    def layer(i):
        p = f"encoder.layer.{i}"
        qkv = {n: linear(f"{p}.attention.attention.{n}") for n in ("query", "key", "value")}
        if not config.qkv_bias:
            qkv = {n: {"kernel": v["kernel"]} for n, v in qkv.items()}
        return {"layernorm_before": norm(f"{p}.layernorm_before"), **qkv,
                "attn_out": linear(f"{p}.attention.output.dense"),
                "layernorm_after": norm(f"{p}.layernorm_after"),
                "fc_in": linear(f"{p}.intermediate.dense"), "fc_out": linear(f"{p}.output.dense")}

    out = {"patch_embeddings": {"kernel": src("embeddings.patch_embeddings.projection.weight"),
                                "bias": src("embeddings.patch_embeddings.projection.bias")},
           "cls_token": src("embeddings.cls_token"),
           "position_embeddings": src("embeddings.position_embeddings"),
           "layers": stacked.layer_sources(layer, config.num_hidden_layers, config.scan_layers),
           "layernorm": norm("layernorm")}
    if config.add_pooling_layer:
        out["pooler"] = linear("pooler.dense")
    return out


def example_inputs(config, module_cls=ViTModel, batch=2):
    c = config
    return (jax.ShapeDtypeStruct((batch, c.num_channels, c.image_size, c.image_size), jnp.float32),)
