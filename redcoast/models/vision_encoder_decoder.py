"""An image encoder and a text decoder joined by cross-attention, in the layout of Hugging Face's
``VisionEncoderDecoderModel`` (e.g. ViT + GPT-2 for captioning, as in the paper's image-captioning
example): ViT encodes the image, a linear ``enc_to_dec_proj`` maps its width to the decoder's
when they differ, and every GPT-2 block attends to the result.

Generation goes through :func:`redcoast.models.generate_seq2seq.generate` with
``pixel_values [B, C, H, W]`` in place of input ids (there is no encoder mask: every patch is
real); the decoder starts from ``decoder_start_token_id``.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import ConfigError
from . import gpt2, hf, vit
from .blocks import dense


@dataclasses.dataclass(frozen=True)
class Config:
    encoder: vit.Config
    decoder: gpt2.Config
    decoder_start_token_id: Any = None  # None: the decoder's bos_token_id
    pad_token_id: Any = None  # None: the decoder's eos_token_id
    eos_token_id: Any = None  # None: the decoder's
    dtype: Any = jnp.float32
    remat: bool = False
    input_ndim = 4  # generate_seq2seq takes pixel_values [B, C, H, W] as the encoder input

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        if not self.decoder.add_cross_attention:
            set_("decoder", dataclasses.replace(self.decoder, add_cross_attention=True))
        # one compute dtype and one remat switch for both halves
        for side in ("encoder", "decoder"):
            sub = getattr(self, side)
            if (sub.dtype, sub.remat) != (self.dtype, self.remat):
                set_(side, dataclasses.replace(sub, dtype=self.dtype, remat=self.remat))
        if self.decoder_start_token_id is None:
            set_("decoder_start_token_id", self.decoder.bos_token_id)
        if self.eos_token_id is None:
            set_("eos_token_id", self.decoder.eos_token_id)
        if self.pad_token_id is None:
            set_("pad_token_id", self.eos_token_id)

    @property
    def projects(self):
        return self.encoder.hidden_size != self.decoder.n_embd

    @classmethod
    def from_hf(cls, d):
        enc, dec = d.get("encoder", {}), d.get("decoder", {})
        if enc.get("model_type") != "vit" or dec.get("model_type") != "gpt2":
            raise ConfigError(f"a vision-encoder-decoder of {enc.get('model_type')!r} and "
                              f"{dec.get('model_type')!r}: redcoast reads ViT + GPT-2 only.")
        if dec.get("cross_attention_hidden_size") not in (None, enc.get("hidden_size")):
            raise ConfigError("decoder.cross_attention_hidden_size differs from the encoder's "
                              "hidden_size; transformers refuses that layout too.")
        return cls(encoder=vit.Config.from_hf(enc), decoder=gpt2.Config.from_hf(dec),
                   decoder_start_token_id=d.get("decoder_start_token_id"),
                   pad_token_id=d.get("pad_token_id"), eos_token_id=d.get("eos_token_id"))

    def to_hf(self):
        decoder = {**self.decoder.to_hf(), "is_decoder": True, "add_cross_attention": True}
        return {"model_type": "vision-encoder-decoder",
                "architectures": ["VisionEncoderDecoderModel"], "is_encoder_decoder": True,
                "tie_word_embeddings": False, "encoder": self.encoder.to_hf(), "decoder": decoder,
                "decoder_start_token_id": self.decoder_start_token_id,
                "pad_token_id": self.pad_token_id, "eos_token_id": self.eos_token_id}


def config_for_tensors(config, reader):
    """The encoder's pooler as the folder holds it (unused for captioning, kept for the round
    trip)."""
    return dataclasses.replace(config, encoder=vit.config_for_tensors(config.encoder, reader,
                                                                      prefix="encoder."))


class VisionEncoderDecoderModel(nnx.Module):
    """``model(pixel_values, decoder_input_ids, decoder_attention_mask=None)`` -> float32 logits
    [B, T, vocab] (teacher forcing); :meth:`encode`, :meth:`cross_kv`, :meth:`decode` and
    :meth:`init_cache` are the pieces generation uses."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        c = config
        self.config = c
        self.encoder = vit.ViTModel(c.encoder, rngs=rngs, param_dtype=param_dtype)
        if c.projects:
            self.enc_to_dec_proj = dense(c.encoder.hidden_size, c.decoder.n_embd, dtype=c.dtype,
                                         param_dtype=param_dtype, rngs=rngs)
        self.decoder = gpt2.GPT2LMHeadModel(c.decoder, rngs=rngs, param_dtype=param_dtype)

    def encode(self, pixel_values, attention_mask=None):
        """The encoder's features in the decoder's width, [B, 1 + patches, n_embd].
        ``attention_mask`` is accepted for the seq2seq protocol and unused (no padding)."""
        del attention_mask
        hidden, _ = self.encoder(pixel_values)
        hidden = hidden.astype(self.config.dtype)
        return self.enc_to_dec_proj(hidden) if self.config.projects else hidden

    def cross_kv(self, encoder_hidden):
        return self.decoder.cross_kv(encoder_hidden)

    def decode(self, decoder_input_ids, encoder_hidden, encoder_mask=None, attention_mask=None,
               positions=None, cache=None, cache_index=None, cross_kv=None):
        """Decoder logits [B, T, vocab] float32 (and the new cache when ``cache`` is given).
        Without a cache ``attention_mask`` [B, T] marks real decoder tokens (padding on the
        right); with one, token t sits at slot and position ``cache_index + t``."""
        del encoder_mask, positions  # every patch is real; positions are the slots
        if cross_kv is None:
            cross_kv = self.cross_kv(encoder_hidden)
        if cache is None:
            return self.decoder(decoder_input_ids, attention_mask, cross_kv=cross_kv)
        b, t = decoder_input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, cache["layers"]["0"]["k"].shape[1]), jnp.int32)
        slots = jnp.broadcast_to(cache_index + jnp.arange(t), (b, t))
        return self.decoder(decoder_input_ids, attention_mask, slots, cache, cache_index,
                            cross_kv=cross_kv)

    def __call__(self, pixel_values, decoder_input_ids, decoder_attention_mask=None):
        return self.decode(decoder_input_ids, self.encode(pixel_values),
                           attention_mask=decoder_attention_mask)

    def init_cache(self, batch_size, max_length, dtype=jnp.float32):
        return self.decoder.init_cache(batch_size, max_length, dtype)


MODULES = {"VisionEncoderDecoderModel": VisionEncoderDecoderModel}
DEFAULT_MODULE = VisionEncoderDecoderModel


def hf_sources(config, module_cls=VisionEncoderDecoderModel):
    """Tensor names as transformers saves VisionEncoderDecoderModel: the encoder's under
    "encoder.", the decoder's under "decoder."."""
    out = {"encoder": vit.hf_sources(config.encoder, prefix="encoder."),
           "decoder": gpt2.hf_sources(config.decoder, gpt2.GPT2LMHeadModel, prefix="decoder.")}
    if config.projects:
        out["enc_to_dec_proj"] = {"kernel": hf.Source("enc_to_dec_proj.weight", transpose=True),
                                  "bias": hf.Source("enc_to_dec_proj.bias")}
    return out


def example_inputs(config, module_cls=VisionEncoderDecoderModel, batch=2, length=8):
    pixels = vit.example_inputs(config.encoder, batch=batch)[0]
    return pixels, jax.ShapeDtypeStruct((batch, min(length, config.decoder.n_positions)), jnp.int32)
