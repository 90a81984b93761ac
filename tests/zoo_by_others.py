"""A zoo of models as public JAX code writes them, for the Trainer's traffic and share (issue 49).

Each builder ``make(n_layers)`` returns a :class:`Zoo`: the parameters, ``loss(params, batch)``,
``make_batch(n)`` (``n`` examples as one batch), ``megatron(batch_per_device)``, the bytes that
Megatron-LM's hand-written plan moves between the model shards per layer (one device, one
training step) and ``whole``, the parameters Megatron keeps whole (its patch and position
embeddings, token-type table and classifier heads are plain replicated ``torch.nn`` layers; a
weight that every shard needs whole for its channels). Each model is written as its source
writes it, not restyled for the analysis; sizes are tests/architectures.py's (hidden 32, 8 heads
of 4, ffn 64, vocab 40, sequence 8), images 16x16 in patches of 4 where a model reads images.

* :func:`mlp_mixer`: google-research/vision_transformer's ``models_mixer.py`` (linen): token
  mixing by ``jnp.swapaxes`` around an ``MlpBlock``.
* :func:`unet`: a DDPM U-Net as yiyixuxu/denoising-diffusion-flax writes it (linen): weight
  standardized convolutions, GroupNorm, time-embedding scale/shift, skip concatenations;
  upsampling by a 2x2 ``nn.ConvTranspose`` (Ronneberger et al.'s up-convolution).
* :func:`roformer`: transformers' ``FlaxRoFormer`` (4.x): BERT post-LN layers, rotary tables
  interleaved by ``jnp.stack``/``reshape`` and applied by broadcasting einsums.
* :func:`vit`: vision_transformer's ``models_vit.py``: a patch-embedding convolution, a class
  token concatenated, learned positions, ``nn.MultiHeadDotProductAttention``.
* :func:`t5`: transformers' ``FlaxT5`` (4.x): relative position buckets, the bias of layer 0
  shared by the later layers, cross-attention, tied and rescaled LM head.
* :func:`mixtral_moe`: a Mixtral-style sparse MoE as simple public JAX ports write it: top-2 by
  ``jax.lax.top_k``, every expert computed densely from stacked [E, d, f] kernels, weighted.
* :func:`gmlp`: gMLP from its paper (Liu et al. 2021, "Pay Attention to MLPs"): a spatial
  gating unit that splits the channels, normalises one half and mixes it along the tokens.
* :func:`nnx_minigpt`: Flax NNX's miniGPT tutorial (JAX AI stack): ``nnx.MultiHeadAttention``,
  post-LN blocks, token and position embeddings.
"""

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from architectures import F, H, NH, T, V, cross_entropy, quick_init
from redcoast.layout.comms import megatron_ideal

IMAGE, PATCH, CLASSES = 16, 4, 10
PATCHES = (IMAGE // PATCH) ** 2          # 16 tokens of an image
E, TOP_K = 8, 2                          # the MoE's experts, experts per token


@dataclasses.dataclass
class Zoo:
    name: str
    params: Any
    loss: Callable          # loss(params, batch) -> scalar
    make_batch: Callable    # make_batch(n, seed=0) -> a batch of n examples (numpy)
    megatron: Callable      # megatron(batch_per_device) -> {'count', 'bytes', 'wire_bytes'}
    whole: tuple = ()       # '/'-joined path prefixes of the parameters Megatron keeps whole


def _ring(n_model_shards):
    """An all-reduce's wire bytes per byte reduced (ring): 2(g-1)/g."""
    return 2 * (n_model_shards - 1) / n_model_shards


def _add(ideal, n_all_reduces, nbytes, n_model_shards):
    """``ideal`` with ``n_all_reduces`` more all-reduces of ``nbytes`` each."""
    return {"count": ideal["count"] + n_all_reduces,
            "bytes": ideal["bytes"] + n_all_reduces * nbytes,
            "wire_bytes": ideal["wire_bytes"] + n_all_reduces * nbytes * _ring(n_model_shards)}


def _np(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def _tokens(n, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (n, T + 1)).astype(np.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def _images(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"images": rng.normal(size=(n, IMAGE, IMAGE, 3)).astype(np.float32),
            "labels": rng.integers(0, CLASSES, n).astype(np.int32)}


def _classifier_loss(model):
    def loss(params, batch):
        logits = model.apply({"params": params}, batch["images"], train=False)
        return cross_entropy(logits, batch["labels"])
    return loss


def _lm_loss(apply):
    def loss(params, batch):
        return cross_entropy(apply(params, batch["inputs"]), batch["targets"])
    return loss


# ---- (a) MLP-Mixer: vision_transformer's models_mixer.py -------------------------------------
def mlp_mixer(n_layers=2, seed=0, tokens_mlp_dim=48):
    """google-research/vision_transformer ``vit_jax/models_mixer.py`` as written there (the head
    initialised as Dense's default instead of zeros, so that the gradients checked are not 0).

    Megatron: each ``MlpBlock`` column- then row-parallel, the token-mixing one over its
    ``tokens_mlp_dim`` (applied to the [batch, channels, tokens] transpose): one all-reduce of
    the [batch, tokens, channels] activation per MLP forward and one backward, 2 + 2 per block,
    as a transformer layer. The stem convolution and the head are replicated (Megatron's ViT
    patch embedding and classifier head are plain ``torch.nn.Linear``)."""
    import flax.linen as nn

    class MlpBlock(nn.Module):
        mlp_dim: int

        @nn.compact
        def __call__(self, x):
            y = nn.Dense(self.mlp_dim)(x)
            y = nn.gelu(y)
            return nn.Dense(x.shape[-1])(y)

    class MixerBlock(nn.Module):
        """Mixer block layer."""
        tokens_mlp_dim: int
        channels_mlp_dim: int

        @nn.compact
        def __call__(self, x):
            y = nn.LayerNorm()(x)
            y = jnp.swapaxes(y, 1, 2)
            y = MlpBlock(self.tokens_mlp_dim, name="token_mixing")(y)
            y = jnp.swapaxes(y, 1, 2)
            x = x + y
            y = nn.LayerNorm()(x)
            return x + MlpBlock(self.channels_mlp_dim, name="channel_mixing")(y)

    class MlpMixer(nn.Module):
        """Mixer architecture."""
        patches: Any
        num_classes: int
        num_blocks: int
        hidden_dim: int
        tokens_mlp_dim: int
        channels_mlp_dim: int

        @nn.compact
        def __call__(self, inputs, *, train):
            del train
            x = nn.Conv(self.hidden_dim, self.patches, strides=self.patches, name="stem")(inputs)
            n, h, w, c = x.shape
            x = jnp.reshape(x, (n, h * w, c))
            for _ in range(self.num_blocks):
                x = MixerBlock(self.tokens_mlp_dim, self.channels_mlp_dim)(x)
            x = nn.LayerNorm(name="pre_head_layer_norm")(x)
            x = jnp.mean(x, axis=1)
            return nn.Dense(self.num_classes, name="head")(x)

    model = MlpMixer((PATCH, PATCH), CLASSES, n_layers, H, tokens_mlp_dim, F)
    params = _np(quick_init(model, seed, _images(1)["images"], train=False)["params"])
    return Zoo("mlp_mixer", params, _classifier_loss(model), _images,
               lambda per_device, n=4: megatron_ideal(per_device, PATCHES, H, n),
               whole=("stem", "head"))


# ---- (b) U-Net: denoising-diffusion-flax's unet.py, up-convolutions -----------------------------
UNET_DIM, UNET_MULTS, UNET_GROUPS = 16, (1, 2), 8


def unet(n_layers=2, seed=0):
    """A DDPM U-Net as yiyixuxu/denoising-diffusion-flax (``unet.py``) writes it: ``ResnetBlock``
    of weight standardized 3x3 convolutions and GroupNorm(8), the time embedding's
    ``Dense(2 * dim)`` split into a scale and a shift; skip connections concatenated on the way
    up; upsampling by a 2x2 stride-2 ``nn.ConvTranspose`` (the port resizes and convolves) and
    no attention blocks (small). ``n_layers``: the ``ResnetBlock`` per level (the port's 2),
    two levels (32 channels at 16x16, 64 at 8x8). Trained on DDPM's noise-prediction loss.

    Megatron (its channel split of a residual block, ``megatron_conv_ideal``): ``conv_0``
    column-parallel (its GroupNorm's 8 groups stay whole on 4 shards, the time embedding's scale
    and shift are split with the channels they scale), ``conv_1`` row-parallel; one all-reduce
    of the block's [batch, H, W, dim] output forward (before ``norm_1``), one of its input
    gradient backward: [batch, H, W, 2 dim] for the up blocks, whose input is the
    concatenation. Also per block, backward: the time embedding's gradient [batch, 4 dim], and
    the per-output-channel sums of ``conv_1``'s weight standardization (2 x [dim], forward and
    backward: its input channels are split). A layer is one block of each level down and up.
    The stem, the down- and up-sampling convolutions, the 1x1 shortcuts and the output
    convolution write or read the blocks' whole input: replicated."""
    import flax.linen as nn

    class SinusoidalPosEmb(nn.Module):
        dim: int

        @nn.compact
        def __call__(self, time):
            half_dim = self.dim // 2
            emb = math.log(10000) / (half_dim - 1)
            emb = jnp.exp(jnp.arange(half_dim, dtype=jnp.float32) * -emb)
            emb = time.astype(jnp.float32)[:, None] * emb[None, :]
            return jnp.concatenate([jnp.sin(emb), jnp.cos(emb)], axis=-1)

    class Downsample(nn.Module):
        dim: int

        @nn.compact
        def __call__(self, x):
            return nn.Conv(self.dim, kernel_size=(4, 4), strides=(2, 2), padding=1)(x)

    class Upsample(nn.Module):
        dim: int

        @nn.compact
        def __call__(self, x):
            return nn.ConvTranspose(self.dim, kernel_size=(2, 2), strides=(2, 2))(x)

    class WeightStandardizedConv(nn.Module):
        """apply weight standardization https://arxiv.org/abs/1903.10520"""
        features: int
        kernel_size: Any = 3
        padding: Any = 1

        @nn.compact
        def __call__(self, x):
            conv = nn.Conv(features=self.features, kernel_size=self.kernel_size,
                           padding=self.padding, parent=None)
            kernel_init = lambda rng, x: conv.init(rng, x)["params"]["kernel"]  # noqa: E731
            bias_init = lambda rng, x: conv.init(rng, x)["params"]["bias"]  # noqa: E731
            kernel = self.param("kernel", kernel_init, x)
            eps = 1e-5
            redux = tuple(range(kernel.ndim - 1))  # reduce over dim_out
            mean = jnp.mean(kernel, axis=redux, keepdims=True)
            var = jnp.var(kernel, axis=redux, keepdims=True)
            standardized_kernel = (kernel - mean) / jnp.sqrt(var + eps)
            bias = self.param("bias", bias_init, x)
            return conv.apply({"params": {"kernel": standardized_kernel, "bias": bias}}, x)

    class ResnetBlock(nn.Module):
        """Convolutional residual block."""
        dim: int
        groups: int = 8

        @nn.compact
        def __call__(self, x, time_emb):
            C = x.shape[-1]
            h = WeightStandardizedConv(features=self.dim, kernel_size=(3, 3), padding=1,
                                       name="conv_0")(x)
            h = nn.GroupNorm(num_groups=self.groups, name="norm_0")(h)
            time_emb = nn.Dense(features=2 * self.dim, name="time_mlp")(nn.swish(time_emb))
            time_emb = time_emb[:, jnp.newaxis, jnp.newaxis, :]
            scale, shift = jnp.split(time_emb, 2, axis=-1)
            h = h * (1 + scale) + shift
            h = nn.swish(h)
            h = WeightStandardizedConv(features=self.dim, kernel_size=(3, 3), padding=1,
                                       name="conv_1")(h)
            h = nn.swish(nn.GroupNorm(num_groups=self.groups, name="norm_1")(h))
            if C != self.dim:
                x = nn.Conv(features=self.dim, kernel_size=(1, 1), name="res_conv_0")(x)
            return x + h

    class Unet(nn.Module):
        dim: int
        dim_mults: tuple
        num_blocks: int
        groups: int = 8

        @nn.compact
        def __call__(self, x, time):
            C = x.shape[-1]
            hs = []
            h = nn.Conv(features=self.dim, kernel_size=(7, 7), padding=3, name="init")(x)
            hs.append(h)
            time_emb = SinusoidalPosEmb(self.dim)(time)
            time_emb = nn.Dense(features=self.dim * 4, name="time_mlp_0")(time_emb)
            time_emb = nn.Dense(features=self.dim * 4, name="time_mlp_1")(nn.gelu(time_emb))
            num_resolutions = len(self.dim_mults)
            for ind in range(num_resolutions):
                for j in range(self.num_blocks):
                    h = ResnetBlock(self.dim * self.dim_mults[ind], self.groups,
                                    name=f"down_{ind}_{j}")(h, time_emb)
                    hs.append(h)
                if ind < num_resolutions - 1:
                    h = Downsample(self.dim * self.dim_mults[ind + 1], name=f"downsample_{ind}")(h)
            h = ResnetBlock(self.dim * self.dim_mults[-1], self.groups, name="mid")(h, time_emb)
            for ind in reversed(range(num_resolutions)):
                for j in range(self.num_blocks):
                    h = jnp.concatenate([h, hs.pop()], axis=-1)
                    h = ResnetBlock(self.dim * self.dim_mults[ind], self.groups,
                                    name=f"up_{ind}_{j}")(h, time_emb)
                if ind > 0:
                    h = Upsample(self.dim * self.dim_mults[ind - 1], name=f"upsample_{ind}")(h)
            h = jnp.concatenate([h, hs.pop()], axis=-1)
            out = ResnetBlock(self.dim, self.groups, name="final")(h, time_emb)
            return nn.Conv(C, kernel_size=(1, 1), name="final_conv")(out)

    model = Unet(UNET_DIM, UNET_MULTS, n_layers, UNET_GROUPS)
    params = _np(quick_init(model, seed, np.zeros((1, IMAGE, IMAGE, 3), np.float32),
                            np.zeros((1,), np.int32))["params"])
    steps = 1000
    alphas_cumprod = np.cumprod(1.0 - np.linspace(1e-4, 0.02, steps)).astype(np.float32)

    def loss(params, batch):  # DDPM's simple loss: the noise predicted from x_t
        a = jnp.asarray(alphas_cumprod)[batch["t"]][:, None, None, None]
        x_t = jnp.sqrt(a) * batch["images"] + jnp.sqrt(1.0 - a) * batch["noise"]
        return jnp.mean((model.apply({"params": params}, x_t, batch["t"]) - batch["noise"]) ** 2)

    def make_batch(n, seed=0):
        rng = np.random.default_rng(seed)
        return {"images": rng.normal(size=(n, IMAGE, IMAGE, 3)).astype(np.float32),
                "noise": rng.normal(size=(n, IMAGE, IMAGE, 3)).astype(np.float32),
                "t": rng.integers(0, steps, n).astype(np.int32)}

    def megatron(per_device, n=4):
        ideal, f4 = {"count": 0, "bytes": 0, "wire_bytes": 0.0}, 4
        for level, mult in enumerate(UNET_MULTS):
            side, dim = IMAGE >> level, UNET_DIM * mult
            act = per_device * side * side * dim * f4
            ideal = _add(ideal, 2, act, n)          # down block: output, then input gradient
            ideal = _add(ideal, 1, act, n)          # up block: output forward
            ideal = _add(ideal, 1, 2 * act, n)      # up block: its concatenated input's gradient
            for _ in range(2):                      # each block: time embedding's gradient,
                ideal = _add(ideal, 1, per_device * 4 * UNET_DIM * f4, n)
                ideal = _add(ideal, 2, 2 * dim * f4, n)  # conv_1's standardization sums
        return ideal

    whole = ("init", "downsample_", "upsample_", "final_conv") + tuple(
        f"{b}/res_conv_0" for b in ("up_0_0", "up_0_1", "up_1_0", "up_1_1", "final"))
    return Zoo("unet", params, loss, make_batch, megatron, whole)


# ---- (c) RoFormer: transformers' FlaxRoFormer -------------------------------------------------
def _create_sinusoidal_positions(n_pos, dim):  # transformers' Flax Marian/RoFormer, as written
    position_enc = np.array([[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)]
                             for pos in range(n_pos)])
    sentinel = dim // 2 + dim % 2
    out = np.zeros_like(position_enc)
    out[:, 0:sentinel] = np.sin(position_enc[:, 0::2])
    out[:, sentinel:] = np.cos(position_enc[:, 1::2])
    return jnp.array(out)


def _apply_rotary_position_embeddings(sinusoidal_pos, query_layer, key_layer):
    sin, cos = jnp.split(sinusoidal_pos, 2, axis=-1)
    sin_pos = jnp.stack([sin, sin], axis=-1).reshape(sinusoidal_pos.shape)
    cos_pos = jnp.stack([cos, cos], axis=-1).reshape(sinusoidal_pos.shape)

    def rotate_layer(layer, sin_pos, cos_pos):
        rotate_half_layer = jnp.stack([-layer[..., 1::2], layer[..., ::2]],
                                      axis=-1).reshape(layer.shape)
        rotary_matrix_cos = jnp.einsum("bslh,...sh->bslh", layer, cos_pos)
        rotary_matrix_sin = jnp.einsum("bslh,...sh->bslh", rotate_half_layer, sin_pos)
        return rotary_matrix_cos + rotary_matrix_sin

    return rotate_layer(query_layer, sin_pos, cos_pos), rotate_layer(key_layer, sin_pos, cos_pos)


def roformer(n_layers=2, seed=0):
    """transformers 4.x ``modeling_flax_roformer.py`` (FlaxRoFormerForMaskedLM), module for
    module with dropout and head masks left out: word and token-type embeddings and LayerNorm (no
    position embeddings), post-LN BERT layers whose Q and K are rotated by the sinusoidal table
    (``jnp.stack([-x[..., 1::2], x[..., ::2]], -1).reshape``, then ``einsum('bslh,...sh->bslh')``),
    ``dot_product_attention_weights`` with a ``lax.select`` mask bias, the MLM head's transform
    and the decoder tied to the word embeddings. Trained on the targets of every position.

    Megatron: 2 + 2 all-reduces of [batch, seq, hidden] per layer (the rotation is per head: it
    moves nothing). Megatron's BERT keeps the token-type table and the LM head's transform
    Dense replicated; the word embeddings and the tied decoder vocabulary-parallel."""
    import flax.linen as nn
    from flax.linen.attention import dot_product_attention_weights
    from jax import lax

    head_dim = H // NH
    normal = jax.nn.initializers.normal(0.02)

    class SelfAttention(nn.Module):
        def setup(self):
            self.query = nn.Dense(H, kernel_init=normal)
            self.key = nn.Dense(H, kernel_init=normal)
            self.value = nn.Dense(H, kernel_init=normal)

        def __call__(self, hidden_states, attention_mask, sinusoidal_pos):
            heads = hidden_states.shape[:2] + (NH, head_dim)
            query_states = self.query(hidden_states).reshape(heads)
            value_states = self.value(hidden_states).reshape(heads)
            key_states = self.key(hidden_states).reshape(heads)
            query_states, key_states = _apply_rotary_position_embeddings(
                sinusoidal_pos, query_states, key_states)
            attention_mask = jnp.expand_dims(attention_mask, axis=(-3, -2))
            attention_bias = lax.select(attention_mask > 0, jnp.full(attention_mask.shape, 0.0),
                                        jnp.full(attention_mask.shape, jnp.finfo(jnp.float32).min))
            attn_weights = dot_product_attention_weights(
                query_states, key_states, bias=attention_bias, deterministic=True)
            attn_output = jnp.einsum("...hqk,...khd->...qhd", attn_weights, value_states)
            return attn_output.reshape(attn_output.shape[:2] + (-1,))

    class Output(nn.Module):  # FlaxRoFormerSelfOutput and FlaxRoFormerOutput: the same code
        def setup(self):
            self.dense = nn.Dense(H, kernel_init=normal)
            self.LayerNorm = nn.LayerNorm(epsilon=1e-12)

        def __call__(self, hidden_states, input_tensor):
            return self.LayerNorm(self.dense(hidden_states) + input_tensor)

    class Attention(nn.Module):
        def setup(self):
            self.self = SelfAttention()
            self.output = Output()

        def __call__(self, hidden_states, attention_mask, sinusoidal_pos):
            attn_output = self.self(hidden_states, attention_mask, sinusoidal_pos)
            return self.output(attn_output, hidden_states)

    class Intermediate(nn.Module):
        def setup(self):
            self.dense = nn.Dense(F, kernel_init=normal)

        def __call__(self, hidden_states):
            return nn.gelu(self.dense(hidden_states), approximate=False)

    class Layer(nn.Module):
        def setup(self):
            self.attention = Attention()
            self.intermediate = Intermediate()
            self.output = Output()

        def __call__(self, hidden_states, attention_mask, sinusoidal_pos):
            attention_output = self.attention(hidden_states, attention_mask, sinusoidal_pos)
            return self.output(self.intermediate(attention_output), attention_output)

    class Embeddings(nn.Module):
        def setup(self):
            self.word_embeddings = nn.Embed(V, H, embedding_init=normal)
            self.token_type_embeddings = nn.Embed(2, H, embedding_init=normal)
            self.LayerNorm = nn.LayerNorm(epsilon=1e-12)

        def __call__(self, input_ids, token_type_ids):
            inputs_embeds = self.word_embeddings(input_ids.astype("i4"))
            token_type_embeddings = self.token_type_embeddings(token_type_ids.astype("i4"))
            return self.LayerNorm(inputs_embeds + token_type_embeddings)

    class Encoder(nn.Module):
        def setup(self):
            self.embed_positions = _create_sinusoidal_positions(4 * T, head_dim)
            self.layer = [Layer(name=str(i)) for i in range(n_layers)]

        def __call__(self, hidden_states, attention_mask):
            sinusoidal_pos = self.embed_positions[: hidden_states.shape[1], :]
            for layer in self.layer:
                hidden_states = layer(hidden_states, attention_mask, sinusoidal_pos)
            return hidden_states

    class PredictionHeadTransform(nn.Module):
        def setup(self):
            self.dense = nn.Dense(H)
            self.LayerNorm = nn.LayerNorm(epsilon=1e-12)

        def __call__(self, hidden_states):
            return self.LayerNorm(nn.gelu(self.dense(hidden_states), approximate=False))

    class LMPredictionHead(nn.Module):
        def setup(self):
            self.transform = PredictionHeadTransform()
            self.decoder = nn.Dense(V, use_bias=False)
            self.bias = self.param("bias", jax.nn.initializers.zeros, (V,))

        def __call__(self, hidden_states, shared_embedding):
            hidden_states = self.transform(hidden_states)
            hidden_states = self.decoder.apply({"params": {"kernel": shared_embedding.T}},
                                               hidden_states)
            return hidden_states + self.bias

    class RoFormerForMaskedLM(nn.Module):
        def setup(self):
            self.embeddings = Embeddings()
            self.encoder = Encoder()
            self.predictions = LMPredictionHead()

        def __call__(self, input_ids):
            attention_mask, token_type_ids = jnp.ones_like(input_ids), jnp.zeros_like(input_ids)
            hidden_states = self.encoder(self.embeddings(input_ids, token_type_ids), attention_mask)
            shared = self.embeddings.variables["params"]["word_embeddings"]["embedding"]
            return self.predictions(hidden_states, shared)

    model = RoFormerForMaskedLM()
    params = _np(quick_init(model, seed, _tokens(1)["inputs"])["params"])
    apply = lambda p, ids: model.apply({"params": p}, ids)  # noqa: E731
    return Zoo("roformer", params, _lm_loss(apply), _tokens,
               lambda per_device, n=4: megatron_ideal(per_device, T, H, n),
               whole=("embeddings/token_type_embeddings", "predictions/transform/dense"))


# ---- (d) ViT: vision_transformer's models_vit.py ----------------------------------------------
def vit(n_layers=2, seed=0):
    """google-research/vision_transformer ``vit_jax/models_vit.py`` (classifier 'token', no
    representation layer, dropout 0; the head initialised as Dense's default, not zeros): a
    patch-embedding convolution, the class token tiled and concatenated, learned positions added,
    pre-LN ``Encoder1DBlock`` of ``nn.MultiHeadDotProductAttention`` and an ``MlpBlock``.

    Megatron: 2 + 2 all-reduces of [batch, 1 + patches, hidden] per layer. Megatron's ViT keeps
    the patch embedding, the position embeddings, the class token and the head replicated."""
    import flax.linen as nn

    class AddPositionEmbs(nn.Module):
        posemb_init: Callable

        @nn.compact
        def __call__(self, inputs):
            pos_emb_shape = (1, inputs.shape[1], inputs.shape[2])
            pe = self.param("pos_embedding", self.posemb_init, pos_emb_shape)
            return inputs + pe

    class MlpBlock(nn.Module):
        mlp_dim: int

        @nn.compact
        def __call__(self, inputs):
            x = nn.Dense(features=self.mlp_dim, kernel_init=nn.initializers.xavier_uniform(),
                         bias_init=nn.initializers.normal(stddev=1e-6))(inputs)
            x = nn.gelu(x)
            return nn.Dense(features=inputs.shape[-1], kernel_init=nn.initializers.xavier_uniform(),
                            bias_init=nn.initializers.normal(stddev=1e-6))(x)

    class Encoder1DBlock(nn.Module):
        mlp_dim: int
        num_heads: int

        @nn.compact
        def __call__(self, inputs):
            x = nn.LayerNorm()(inputs)
            x = nn.MultiHeadDotProductAttention(kernel_init=nn.initializers.xavier_uniform(),
                                                broadcast_dropout=False, deterministic=True,
                                                num_heads=self.num_heads)(x, x)
            x = x + inputs
            y = nn.LayerNorm()(x)
            y = MlpBlock(mlp_dim=self.mlp_dim)(y)
            return x + y

    class Encoder(nn.Module):
        num_layers: int
        mlp_dim: int
        num_heads: int

        @nn.compact
        def __call__(self, x):
            x = AddPositionEmbs(posemb_init=nn.initializers.normal(stddev=0.02),
                                name="posembed_input")(x)
            for lyr in range(self.num_layers):
                x = Encoder1DBlock(mlp_dim=self.mlp_dim, name=f"encoderblock_{lyr}",
                                   num_heads=self.num_heads)(x)
            return nn.LayerNorm(name="encoder_norm")(x)

    class VisionTransformer(nn.Module):
        num_classes: int
        patches: Any
        hidden_size: int
        transformer: dict

        @nn.compact
        def __call__(self, inputs, *, train):
            x = nn.Conv(features=self.hidden_size, kernel_size=self.patches, strides=self.patches,
                        padding="VALID", name="embedding")(inputs)
            n, h, w, c = x.shape
            x = jnp.reshape(x, [n, h * w, c])
            cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
            cls = jnp.tile(cls, [n, 1, 1])
            x = jnp.concatenate([cls, x], axis=1)
            x = Encoder(name="Transformer", **self.transformer)(x)
            x = x[:, 0]
            return nn.Dense(features=self.num_classes, name="head")(x)

    model = VisionTransformer(CLASSES, (PATCH, PATCH), H,
                              {"num_layers": n_layers, "mlp_dim": F, "num_heads": NH})
    params = _np(quick_init(model, seed, _images(1)["images"], train=False)["params"])
    return Zoo("vit", params, _classifier_loss(model), _images,
               lambda per_device, n=4: megatron_ideal(per_device, PATCHES + 1, H, n),
               whole=("embedding", "cls", "Transformer/posembed_input", "head"))


# ---- (e) T5: transformers' FlaxT5 --------------------------------------------------------------
def t5(n_layers=2, seed=0, num_buckets=32, max_distance=128):
    """transformers 4.x ``modeling_flax_t5.py`` (FlaxT5ForConditionalGeneration, relu MLP, tied
    embeddings), module for module with dropout and the decoding cache left out:
    ``FlaxT5LayerNorm`` (a scale, no mean), ``FlaxT5Attention`` with ``_relative_position_bucket``
    and ``compute_bias`` in layer 0 of each stack, its bias (plus the mask) handed to the later
    layers; ``query_states *= sqrt(d)`` against ``dot_product_attention_weights``' scaling;
    the LM head applied to the rescaled ``sequence_output * d_model ** -0.5`` with the shared
    embedding's transpose as its kernel. ``n_layers`` encoder and ``n_layers`` decoder layers.

    Megatron: an encoder layer 2 + 2 all-reduces of [batch, seq, hidden], a decoder layer 3 + 3
    (self-attention, cross-attention, MLP; the encoder output's gradient from every layer's K/V
    summed once, as ``megatron_ideal(cross_attention=True)`` counts). The relative bias tables
    ([buckets, heads]) split with the heads."""
    import flax.linen as nn
    from flax.linen import combine_masks, make_causal_mask
    from flax.linen.attention import dot_product_attention_weights

    d_kv, f = H // NH, 1.0

    class T5LayerNorm(nn.Module):
        hidden_size: int
        eps: float = 1e-6

        def setup(self):
            self.weight = self.param("weight", jax.nn.initializers.ones, (self.hidden_size,))

        def __call__(self, hidden_states):
            variance = jnp.power(hidden_states.astype("f4"), 2).mean(axis=-1, keepdims=True)
            hidden_states = hidden_states / jnp.sqrt(variance + self.eps)
            return self.weight * hidden_states

    class DenseReluDense(nn.Module):
        def setup(self):
            wi_init_std, wo_init_std = f * (H ** -0.5), f * (F ** -0.5)
            normal = jax.nn.initializers.normal
            self.wi = nn.Dense(F, use_bias=False, kernel_init=normal(wi_init_std))
            self.wo = nn.Dense(H, use_bias=False, kernel_init=normal(wo_init_std))

        def __call__(self, hidden_states):
            return self.wo(jax.nn.relu(self.wi(hidden_states)))

    class LayerFF(nn.Module):
        def setup(self):
            self.DenseReluDense = DenseReluDense()
            self.layer_norm = T5LayerNorm(H)

        def __call__(self, hidden_states):
            return hidden_states + self.DenseReluDense(self.layer_norm(hidden_states))

    class Attention(nn.Module):
        has_relative_attention_bias: bool = False
        causal: bool = False

        def setup(self):
            inner_dim = NH * d_kv
            q_init_std = f * ((inner_dim * d_kv) ** -0.5)
            kv_init_std = o_init_std = f * (inner_dim ** -0.5)
            normal = jax.nn.initializers.normal
            self.q = nn.Dense(inner_dim, use_bias=False, kernel_init=normal(q_init_std))
            self.k = nn.Dense(inner_dim, use_bias=False, kernel_init=normal(kv_init_std))
            self.v = nn.Dense(inner_dim, use_bias=False, kernel_init=normal(kv_init_std))
            self.o = nn.Dense(H, use_bias=False, kernel_init=normal(o_init_std))
            if self.has_relative_attention_bias:
                self.relative_attention_bias = nn.Embed(num_buckets, NH,
                                                        embedding_init=normal(kv_init_std))

        @staticmethod
        def _relative_position_bucket(relative_position, bidirectional=True, num_buckets=32,
                                      max_distance=128):
            relative_buckets = 0
            if bidirectional:
                num_buckets //= 2
                relative_buckets += (relative_position > 0) * num_buckets
                relative_position = jnp.abs(relative_position)
            else:
                relative_position = -jnp.clip(relative_position, max=0)
            max_exact = num_buckets // 2
            is_small = relative_position < max_exact
            relative_position_if_large = max_exact + (
                jnp.log(relative_position / max_exact) / jnp.log(max_distance / max_exact)
                * (num_buckets - max_exact))
            relative_position_if_large = jnp.clip(relative_position_if_large, max=num_buckets - 1)
            relative_buckets += jnp.where(is_small, relative_position, relative_position_if_large)
            return relative_buckets.astype("i4")

        def compute_bias(self, query_length, key_length):
            context_position = jnp.arange(query_length, dtype="i4")[:, None]
            memory_position = jnp.arange(key_length, dtype="i4")[None, :]
            relative_position = memory_position - context_position
            relative_position_bucket = self._relative_position_bucket(
                relative_position, bidirectional=(not self.causal), num_buckets=num_buckets,
                max_distance=max_distance)
            values = self.relative_attention_bias(relative_position_bucket)
            return values.transpose((2, 0, 1))[None, :, :, :]

        def _split_heads(self, hidden_states):
            return hidden_states.reshape(hidden_states.shape[:2] + (NH, d_kv))

        def _merge_heads(self, hidden_states):
            return hidden_states.reshape(hidden_states.shape[:2] + (NH * d_kv,))

        def __call__(self, hidden_states, attention_mask=None, key_value_states=None,
                     position_bias=None):
            batch_size = hidden_states.shape[0]
            query_states = self.q(hidden_states)
            kv = hidden_states if key_value_states is None else key_value_states
            key_states = self.k(kv)
            value_states = self.v(kv)
            query_states = self._split_heads(query_states)
            key_states = self._split_heads(key_states)
            value_states = self._split_heads(value_states)
            query_states *= jnp.sqrt(query_states.shape[-1])
            if self.causal:
                causal_attention_mask = make_causal_mask(attention_mask, dtype="bool")
                causal_attention_mask = jnp.broadcast_to(
                    causal_attention_mask, (batch_size,) + causal_attention_mask.shape[1:])
                attention_mask = jnp.broadcast_to(
                    jnp.expand_dims(attention_mask, axis=(-3, -2)), causal_attention_mask.shape)
                attention_mask = combine_masks(attention_mask, causal_attention_mask)
            elif attention_mask is not None:
                attention_mask = jnp.expand_dims(attention_mask, axis=(-3, -2))
            if attention_mask is not None:
                attention_mask = jax.lax.select(attention_mask > 0,
                                                jnp.full(attention_mask.shape, 0.0),
                                                jnp.full(attention_mask.shape, -1e4))
            if position_bias is None:
                if self.has_relative_attention_bias:
                    position_bias = self.compute_bias(query_states.shape[1], key_states.shape[1])
                elif attention_mask is not None:
                    position_bias = jnp.zeros_like(attention_mask)
                else:
                    position_bias = jnp.zeros((1, NH, query_states.shape[1], key_states.shape[1]))
                if attention_mask is not None:
                    position_bias = position_bias + attention_mask
            attn_weights = dot_product_attention_weights(
                query_states, key_states, bias=position_bias, deterministic=True)
            attn_output = jnp.einsum("...hqk,...khd->...qhd", attn_weights, value_states)
            return self.o(self._merge_heads(attn_output)), position_bias

    class LayerSelfAttention(nn.Module):
        has_relative_attention_bias: bool
        causal: bool

        def setup(self):
            self.SelfAttention = Attention(self.has_relative_attention_bias, self.causal)
            self.layer_norm = T5LayerNorm(H)

        def __call__(self, hidden_states, attention_mask, position_bias):
            out, position_bias = self.SelfAttention(self.layer_norm(hidden_states), attention_mask,
                                                    position_bias=position_bias)
            return hidden_states + out, position_bias

    class LayerCrossAttention(nn.Module):
        def setup(self):
            self.EncDecAttention = Attention(False, False)
            self.layer_norm = T5LayerNorm(H)

        def __call__(self, hidden_states, key_value_states, attention_mask, position_bias):
            out, position_bias = self.EncDecAttention(
                self.layer_norm(hidden_states), attention_mask, key_value_states, position_bias)
            return hidden_states + out, position_bias

    class Block(nn.Module):
        has_relative_attention_bias: bool
        causal: bool

        def setup(self):
            layer = (LayerSelfAttention(self.has_relative_attention_bias, self.causal, name="0"),)
            if self.causal:
                layer += (LayerCrossAttention(name="1"),)
            self.layer = layer + (LayerFF(name=str(len(layer))),)

        def __call__(self, hidden_states, attention_mask, position_bias, encoder_hidden_states,
                     encoder_attention_mask, encoder_decoder_position_bias):
            hidden_states, position_bias = self.layer[0](hidden_states, attention_mask,
                                                         position_bias)
            if self.causal:
                hidden_states, encoder_decoder_position_bias = self.layer[1](
                    hidden_states, encoder_hidden_states, encoder_attention_mask,
                    encoder_decoder_position_bias)
            return self.layer[-1](hidden_states), position_bias, encoder_decoder_position_bias

    class Stack(nn.Module):
        causal: bool
        embed_tokens: nn.Module

        def setup(self):
            self.block = [Block(i == 0, self.causal, name=str(i)) for i in range(n_layers)]
            self.final_layer_norm = T5LayerNorm(H)

        def __call__(self, input_ids, attention_mask, encoder_hidden_states=None,
                     encoder_attention_mask=None):
            hidden_states = self.embed_tokens(input_ids)
            position_bias = encoder_decoder_position_bias = None
            for layer_module in self.block:
                hidden_states, position_bias, encoder_decoder_position_bias = layer_module(
                    hidden_states, attention_mask, position_bias, encoder_hidden_states,
                    encoder_attention_mask, encoder_decoder_position_bias)
            return self.final_layer_norm(hidden_states)

    class T5ForConditionalGeneration(nn.Module):
        def setup(self):
            self.shared = nn.Embed(V, H, embedding_init=jax.nn.initializers.normal(f))
            self.encoder = Stack(False, self.shared)
            self.decoder = Stack(True, self.shared)
            self.lm_head = nn.Dense(V, use_bias=False)

        def __call__(self, input_ids, decoder_input_ids):
            attention_mask = jnp.ones_like(input_ids)
            decoder_attention_mask = jnp.ones_like(decoder_input_ids)
            encoder_outputs = self.encoder(input_ids, attention_mask)
            sequence_output = self.decoder(decoder_input_ids, decoder_attention_mask,
                                           encoder_outputs, attention_mask)
            sequence_output = sequence_output * (H ** -0.5)
            shared_embedding = self.shared.variables["params"]["embedding"]
            return self.lm_head.apply({"params": {"kernel": shared_embedding.T}}, sequence_output)

    model = T5ForConditionalGeneration()
    ids = _tokens(1)["inputs"]
    params = _np(quick_init(model, seed, ids, ids)["params"])

    def loss(params, batch):
        logits = model.apply({"params": params}, batch["src"], batch["inputs"])
        return cross_entropy(logits, batch["targets"])

    def make_batch(n, seed=0):
        return {**_tokens(n, seed), "src": _tokens(n, seed + 1)["inputs"]}

    def megatron(per_device, n=4):
        enc = megatron_ideal(per_device, T, H, n)
        dec = megatron_ideal(per_device, T, H, n, cross_attention=True)
        return {k: enc[k] + dec[k] for k in enc}

    return Zoo("t5", params, loss, make_batch, megatron)


# ---- (f) Mixtral-style sparse MoE: top-2 by lax.top_k, experts dense ---------------------------
def _rotate_half(x):  # transformers' Llama / Mixtral
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return jnp.concatenate((-x2, x1), axis=-1)


def mixtral_moe(n_layers=2, seed=0):
    """A Mixtral-style decoder as simple public JAX ports write it (linen): RMSNorm, rotary
    attention (``rotate_half`` by slices and concatenate), and a sparse MoE whose router is a
    ``Dense(E)``, softmax, ``jax.lax.top_k`` (k=2), the top weights renormalised and scattered
    back by ``one_hot`` into [b, s, E] gates; every expert is computed on every token from
    stacked [E, d, f] SwiGLU kernels (``einsum('bsd,edf->bsef')``) and the outputs weighted by
    the gates (``einsum('bsed,bse->bsd')``). 8 experts, ffn 64 each.

    Megatron (experts split by expert, the tokens on every shard, as
    tests/test_written_by_others.py's ideal): 2 + 2 all-reduces of [batch, seq, hidden] per
    layer, and the top-k gates' gradient ([batch, seq, 2], from the shards of the chosen
    experts) summed once more. The router is replicated (Megatron-core's ``TopKRouter``)."""
    import flax.linen as nn

    head_dim = H // NH
    inv = 1.0 / (10000 ** (np.arange(0, head_dim, 2) / head_dim))
    freqs = np.outer(np.arange(T), inv)
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)

    class TopKRouter(nn.Module):
        num_experts: int
        k: int = 2

        @nn.compact
        def __call__(self, inputs):
            logits = nn.Dense(self.num_experts, use_bias=False)(inputs)
            probs = jax.nn.softmax(logits, axis=-1)
            top_k_weights, top_k_indices = jax.lax.top_k(probs, self.k)
            weights = top_k_weights / (top_k_weights.sum(axis=-1, keepdims=True) + 1e-9)
            mask = jax.nn.one_hot(top_k_indices, self.num_experts)    # [b, s, k, E]
            return jnp.sum(mask * weights[..., None], axis=-2)         # [b, s, E]

    class SparseMoE(nn.Module):
        num_experts: int
        ffn_dim: int

        @nn.compact
        def __call__(self, x):
            init = nn.initializers.lecun_normal(batch_axis=(0,))
            w1 = self.param("w1", init, (self.num_experts, x.shape[-1], self.ffn_dim))
            w3 = self.param("w3", init, (self.num_experts, x.shape[-1], self.ffn_dim))
            w2 = self.param("w2", init, (self.num_experts, self.ffn_dim, x.shape[-1]))
            gates = TopKRouter(self.num_experts, TOP_K, name="gate")(x)
            h = nn.silu(jnp.einsum("bsd,edf->bsef", x, w1)) * jnp.einsum("bsd,edf->bsef", x, w3)
            expert_outputs = jnp.einsum("bsef,efd->bsed", h, w2)
            return jnp.einsum("bsed,bse->bsd", expert_outputs, gates)

    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x):
            b, s, _ = x.shape
            q = nn.Dense(H, use_bias=False, name="q_proj")(x).reshape(b, s, NH, head_dim)
            k = nn.Dense(H, use_bias=False, name="k_proj")(x).reshape(b, s, NH, head_dim)
            v = nn.Dense(H, use_bias=False, name="v_proj")(x).reshape(b, s, NH, head_dim)
            c, sn = cos[None, :s, None, :], sin[None, :s, None, :]
            q, k = q * c + _rotate_half(q) * sn, k * c + _rotate_half(k) * sn
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
            causal = jnp.tril(jnp.ones((s, s), bool))
            scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
            o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
            return nn.Dense(H, use_bias=False, name="o_proj")(o.reshape(b, s, H))

    class DecoderLayer(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x + Attention(name="self_attn")(nn.RMSNorm(name="input_layernorm")(x))
            y = nn.RMSNorm(name="post_attention_layernorm")(x)
            return x + SparseMoE(E, F, name="block_sparse_moe")(y)

    class Mixtral(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(V, H, name="embed_tokens")(ids)
            for i in range(n_layers):
                x = DecoderLayer(name=f"layers_{i}")(x)
            return nn.Dense(V, use_bias=False, name="lm_head")(nn.RMSNorm(name="norm")(x))

    model = Mixtral()
    params = _np(quick_init(model, seed, _tokens(1)["inputs"])["params"])
    apply = lambda p, ids: model.apply({"params": p}, ids)  # noqa: E731

    def megatron(per_device, n=4):
        return _add(megatron_ideal(per_device, T, H, n), 1, per_device * T * TOP_K * 4, n)

    return Zoo("mixtral_moe", params, _lm_loss(apply), _tokens, megatron,
               whole=tuple(f"layers_{i}/block_sparse_moe/gate" for i in range(n_layers)))


# ---- (g) gMLP: from the paper ------------------------------------------------------------------
GMLP_FFN = 2 * F  # d_ffn: the spatial gating unit's halves are F channels each


def gmlp(n_layers=2, seed=0):
    """gMLP as its paper writes it (Liu et al. 2021, Figure 1's pseudo-code) in linen, on
    tokens: each block LayerNorm, ``Dense(d_ffn)``, GELU, the spatial gating unit
    (``u, v = split(x, 2, channel)``; ``v = LayerNorm(v)``; ``v`` projected along the tokens
    by a ``Dense(n)`` on its transpose, weights near zero, bias one; ``u * v``), then
    ``Dense(d_model)`` and the residual. Bidirectional (no causal mask on the spatial weights).

    Megatron: the block is one MLP, column- then row-parallel, with ``u`` and ``v``'s matching
    channels on one shard (a fused gate/up split, as SwiGLU's): one all-reduce of [batch, seq,
    hidden] forward, one backward. The spatial projection mixes tokens channel by channel: on
    split channels it moves nothing, but its [seq, seq] weight and bias are needed whole by
    every shard and their gradient is summed over the shards (one all-reduce per block). The
    LayerNorm on ``v`` normalises over the split channels: its two statistics per token (mean and
    mean square) are all-reduced forward, its two sums per token backward: [batch, seq, 2]
    each way."""
    import flax.linen as nn

    class SpatialGatingUnit(nn.Module):
        @nn.compact
        def __call__(self, x):
            u, v = jnp.split(x, 2, axis=-1)
            v = nn.LayerNorm()(v)
            n = v.shape[1]
            v = jnp.swapaxes(v, 1, 2)
            v = nn.Dense(n, kernel_init=nn.initializers.uniform(1e-3 / n),
                         bias_init=nn.initializers.ones)(v)
            v = jnp.swapaxes(v, 1, 2)
            return u * v

    class gMLPBlock(nn.Module):
        d_model: int
        d_ffn: int

        @nn.compact
        def __call__(self, x):
            shortcut = x
            x = nn.LayerNorm()(x)
            x = nn.Dense(self.d_ffn, name="channel_proj1")(x)
            x = nn.gelu(x)
            x = SpatialGatingUnit(name="sgu")(x)
            x = nn.Dense(self.d_model, name="channel_proj2")(x)
            return x + shortcut

    class gMLP(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(V, H, name="embed")(ids)
            for i in range(n_layers):
                x = gMLPBlock(H, GMLP_FFN, name=f"block_{i}")(x)
            return nn.Dense(V, use_bias=False, name="head")(nn.LayerNorm(name="norm")(x))

    model = gMLP()
    params = _np(quick_init(model, seed, _tokens(1)["inputs"])["params"])
    apply = lambda p, ids: model.apply({"params": p}, ids)  # noqa: E731

    def megatron(per_device, n=4):
        ideal = megatron_ideal(per_device, T, H, n)
        ideal = {k: v / 2 for k, v in ideal.items()}             # one MLP per block, not two
        ideal = _add(ideal, 2, per_device * T * 2 * 4, n)        # v's LayerNorm: forward, backward
        return _add(ideal, 1, (T * T + T) * 4, n)                 # the spatial weight's gradient

    return Zoo("gmlp", params, _lm_loss(apply), _tokens, megatron,
               whole=tuple(f"block_{i}/sgu/Dense_0" for i in range(n_layers)))


# ---- (h) Flax NNX: the miniGPT tutorial --------------------------------------------------------
def nnx_minigpt(n_layers=2, seed=0):
    """The JAX AI stack's "Train a miniGPT language model with JAX" (Flax NNX) as written there,
    without its ``nnx.with_partitioning`` annotations (redcoast plans the layout): a
    ``TransformerBlock`` of ``nnx.MultiHeadAttention`` under a ``tril`` mask, dropout, post-LN
    ``nnx.LayerNorm`` and a ReLU MLP; ``TokenAndPositionEmbedding`` of two ``nnx.Embed``; an
    ``nnx.Linear`` output layer. Split into a params pytree and a pure apply (``nnx.split``,
    ``nnx.to_pure_dict``), as NNX users hand one to a JAX trainer.

    Megatron: 2 + 2 all-reduces of [batch, seq, hidden] per layer; the position embeddings
    replicated (Megatron's ``position_embeddings`` is a plain ``torch.nn.Embedding``)."""
    from flax import nnx

    def causal_attention_mask(seq_len):
        return jnp.tril(jnp.ones((seq_len, seq_len)))

    class TransformerBlock(nnx.Module):
        def __init__(self, embed_dim, num_heads, ff_dim, *, rngs, rate=0.1):
            self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim,
                                              kernel_init=nnx.initializers.xavier_uniform(),
                                              bias_init=nnx.initializers.zeros_init(), rngs=rngs)
            self.dropout1 = nnx.Dropout(rate=rate)
            self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)
            self.linear1 = nnx.Linear(in_features=embed_dim, out_features=ff_dim,
                                      kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs)
            self.linear2 = nnx.Linear(in_features=ff_dim, out_features=embed_dim,
                                      kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs)
            self.dropout2 = nnx.Dropout(rate=rate)
            self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)

        def __call__(self, inputs, training: bool = False):
            _, seq_len, _ = inputs.shape
            mask = causal_attention_mask(seq_len)
            attention_output = self.mha(inputs_q=inputs, mask=mask, decode=False)
            attention_output = self.dropout1(attention_output, deterministic=not training)
            out1 = self.layer_norm1(inputs + attention_output)
            ffn_output = self.linear1(out1)
            ffn_output = nnx.relu(ffn_output)
            ffn_output = self.linear2(ffn_output)
            ffn_output = self.dropout2(ffn_output, deterministic=not training)
            return self.layer_norm2(out1 + ffn_output)

    class TokenAndPositionEmbedding(nnx.Module):
        def __init__(self, maxlen, vocab_size, embed_dim, *, rngs):
            self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
            self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

        def __call__(self, x):
            positions = jnp.arange(0, x.shape[1])[None, :]
            return self.token_emb(x) + self.pos_emb(positions)

    class MiniGPT(nnx.Module):
        def __init__(self, maxlen, vocab_size, embed_dim, num_heads, feed_forward_dim,
                     num_transformer_blocks, rngs):
            self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim,
                                                             rngs=rngs)
            self.transformer_blocks = nnx.List([
                TransformerBlock(embed_dim, num_heads, feed_forward_dim, rngs=rngs)
                for _ in range(num_transformer_blocks)])
            self.output_layer = nnx.Linear(in_features=embed_dim, out_features=vocab_size,
                                           kernel_init=nnx.initializers.xavier_uniform(),
                                           bias_init=nnx.initializers.zeros_init(), rngs=rngs)

        def __call__(self, inputs, training: bool = False):
            x = self.embedding_layer(inputs)
            for transformer_block in self.transformer_blocks:
                x = transformer_block(x, training=training)
            return self.output_layer(x)

    maxlen = 3 * T  # a context longer than the batch's sequences, as the tutorial's
    graphdef, state, rest = nnx.split(MiniGPT(maxlen, V, H, NH, F, n_layers, rngs=nnx.Rngs(seed)),
                                      nnx.Param, ...)
    params = _np(nnx.to_pure_dict(state))

    def forward(p, ids):
        st = jax.tree_util.tree_map(lambda x: x, state)
        nnx.replace_by_pure_dict(st, p)
        return nnx.merge(graphdef, st, rest)(ids)

    return Zoo("nnx_minigpt", params, _lm_loss(forward), _tokens,
               lambda per_device, n=4: megatron_ideal(per_device, T, H, n),
               whole=("embedding_layer/pos_emb",))


ZOO = {f.__name__: f for f in (mlp_mixer, unet, roformer, vit, t5, mixtral_moe, gmlp, nnx_minigpt)}
