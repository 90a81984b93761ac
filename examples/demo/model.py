"""A small decoder-only transformer language model (GPT-style, pre-LayerNorm) in Flax Linen."""

import flax.linen as nn
import jax.numpy as jnp


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions."""
    n_heads: int

    @nn.compact
    def __call__(self, x):
        batch, length, dim = x.shape
        head_dim = dim // self.n_heads
        split = lambda y: y.reshape(batch, length, self.n_heads, head_dim)
        q = split(nn.Dense(dim, name="query")(x))
        k = split(nn.Dense(dim, name="key")(x))
        v = split(nn.Dense(dim, name="value")(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(x.dtype)
        causal = jnp.tril(jnp.ones((length, length), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, dim)
        return nn.Dense(dim, name="out")(out)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""
    n_heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        x = x + CausalSelfAttention(self.n_heads, name="attn")(nn.LayerNorm(name="ln_attn")(x))
        h = nn.Dense(self.mlp_dim, name="mlp_in")(nn.LayerNorm(name="ln_mlp")(x))
        return x + nn.Dense(x.shape[-1], name="mlp_out")(nn.gelu(h))


class TransformerLM(nn.Module):
    """Token ids (batch, length) -> next-token logits (batch, length, vocab_size)."""
    vocab_size: int
    max_len: int
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_dim: int = 256

    @nn.compact
    def __call__(self, input_ids):
        positions = jnp.arange(input_ids.shape[1])[None]
        x = nn.Embed(self.vocab_size, self.dim, name="tok_embed")(input_ids)
        x = x + nn.Embed(self.max_len, self.dim, name="pos_embed")(positions)
        for i in range(self.n_layers):
            x = Block(self.n_heads, self.mlp_dim, name=f"block_{i}")(x)
        x = nn.LayerNorm(name="ln_final")(x)
        return nn.Dense(self.vocab_size, name="lm_head")(x)
