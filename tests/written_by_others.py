"""Small transformer LMs in patterns seen in public JAX code that the data-flow plan must read
(issue 49). Each builder ``make(n_layers)`` returns ``(model, params, loss(params, batch))`` for
the Trainer; sizes are tests/architectures.py's (hidden 32, 8 heads of 4, ffn 64, vocab 40,
sequence 8).

* :func:`einsum_rotary`: Flax linen, rotary embeddings applied as an elementwise einsum
  (``einsum("bslh,...sh->bslh", q, cos)``: no contracted axis), rotate-half by split/concatenate.
* :func:`one_piece_split`: Flax NNX, a generic head splitter that calls ``jnp.split(x, parts)``
  with one part for Q and two for a fused K/V projection.
* :func:`einsum_moe`: Flax linen, a mixture of experts as Switch / Flaxformer / Mixtral ports
  write it: router ``Dense(E)``, softmax, top-2 by arg-max (GShard's ``top2_gating``), one-hot
  dispatch and combine tensors of a fixed capacity, ``einsum('gsec,gsm->egcm', dispatch, x)``,
  experts stacked in [E, d, f] kernels applied by einsum, combined back by ``einsum('gsec,egcm->gsm', combine, y)``.
* :func:`lstm_lm`: Flax linen's ``nn.RNN(nn.LSTMCell)``, a recurrent cell under ``lax.scan``.

The fifth pattern, a depthwise convolution before an MLP (ConvNeXt), is
tests/cnn_architectures.py's ``convnext``, tested with the other CNNs in tests/test_conv_tp.py.
"""

import jax
import jax.numpy as jnp
import numpy as np

from architectures import F, H, HD, NH, T, V, attend, cross_entropy, nnx_lm, quick_init


def _rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def _apply_rotary(x, cos, sin):
    # written as in public code: an einsum that only broadcasts (no contracted axis)
    return (jnp.einsum("bslh,...sh->bslh", x, cos)
            + jnp.einsum("bslh,...sh->bslh", _rotate_half(x), sin))


def _rotary_tables(seq, dim):
    inv = 1.0 / (10000 ** (jnp.arange(0, dim, 2) / dim))
    ang = jnp.arange(seq)[:, None] * inv[None]
    ang = jnp.concatenate([ang, ang], -1)
    return jnp.cos(ang), jnp.sin(ang)


def _lm_loss(model_apply):
    def loss(params, batch):
        return cross_entropy(model_apply(params, batch["inputs"]), batch["targets"])
    return loss


def _linen_lm(model, seed):
    """``(apply, params, loss)`` of a Flax linen LM taking token ids."""
    ids = np.zeros((2, T), np.int32)
    params = jax.tree_util.tree_map(np.asarray, quick_init(model, seed, ids)["params"])
    apply = lambda p, ids: model.apply({"params": p}, ids)  # noqa: E731
    return apply, params, _lm_loss(apply)


def einsum_rotary(n_layers=2, seed=0):
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, cos, sin):
            b, s, _ = x.shape
            y = nn.RMSNorm()(x)
            q = nn.Dense(H, use_bias=False, name="q_proj")(y).reshape(b, s, NH, HD)
            k = nn.Dense(H, use_bias=False, name="k_proj")(y).reshape(b, s, NH, HD)
            v = nn.Dense(H, use_bias=False, name="v_proj")(y).reshape(b, s, NH, HD)
            q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
            x = x + nn.Dense(H, use_bias=False, name="o_proj")(attend(q, k, v).reshape(b, s, H))
            y = nn.RMSNorm()(x)
            return x + nn.Dense(H, use_bias=False, name="down")(
                nn.silu(nn.Dense(F, use_bias=False, name="up")(y)))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(V, H)(ids)
            cos, sin = _rotary_tables(ids.shape[1], HD)
            for _ in range(n_layers):
                x = Block()(x, cos, sin)
            return nn.Dense(V, use_bias=False, name="lm_head")(nn.RMSNorm()(x))

    return _linen_lm(LM(), seed)


def _split_heads(x, parts):
    """A generic splitter as public code writes it: the fused projection cut into ``parts``."""
    return [p.reshape(p.shape[:2] + (NH, HD)) for p in jnp.split(x, parts, axis=2)]


def one_piece_split(n_layers=2, seed=0):
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1, self.norm2 = nnx.RMSNorm(H, rngs=rngs), nnx.RMSNorm(H, rngs=rngs)
            self.q = nnx.Linear(H, H, use_bias=False, rngs=rngs)
            self.kv = nnx.Linear(H, 2 * H, use_bias=False, rngs=rngs)
            self.o = nnx.Linear(H, H, use_bias=False, rngs=rngs)
            self.up = nnx.Linear(H, F, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(F, H, use_bias=False, rngs=rngs)

        def __call__(self, x):
            y = self.norm1(x)
            (q,) = _split_heads(self.q(y), 1)
            k, v = _split_heads(self.kv(y), 2)
            o = attend(q, k, v)
            x = x + self.o(o.reshape(o.shape[:2] + (H,)))
            return x + self.down(nnx.gelu(self.up(self.norm2(x))))

    params, apply = nnx_lm(Block, n_layers, seed)
    return apply, params, _lm_loss(apply)


E, TOP_K, CAPACITY = 8, 2, 4  # experts, experts per token, slots per expert per group


def _top_2_gating(probs, k, capacity):
    """GShard's ``top2_gating`` / Switch's router as public code writes them: each token's best
    expert by arg-max, then the best of the rest, their gates renormalised; a slot in each
    expert's buffer by priority (first choices first, then tokens in order), tokens over
    capacity dropped. Returns the [g, s, E, C] dispatch (0/1) and combine (gate-weighted)
    tensors."""
    g, s, n_exp = probs.shape
    masks, gates, rest = [], [], probs
    for _ in range(k):
        mask = jax.nn.one_hot(jnp.argmax(rest, axis=-1), n_exp, dtype=probs.dtype)
        masks.append(mask)
        gates.append(jnp.sum(probs * mask, axis=-1))
        rest = rest * (1.0 - mask)
    mask, gates = jnp.stack(masks, 2), jnp.stack(gates, -1)     # [g, s, k, E], [g, s, k]
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    by_priority = jnp.swapaxes(mask, 1, 2).reshape(g, k * s, n_exp)
    slot = jnp.cumsum(by_priority, axis=1) * by_priority - 1.0  # position in the expert's buffer
    slot = jnp.swapaxes(slot.reshape(g, k, s, n_exp), 1, 2)     # [g, s, k, E]
    mask = mask * (slot < capacity)
    slot_onehot = jax.nn.one_hot(jnp.sum(slot * mask, axis=-1).astype(jnp.int32), capacity,
                                 dtype=probs.dtype)             # [g, s, k, C]
    dispatch = jnp.einsum("gske,gskc->gsec", mask, slot_onehot)
    combine = jnp.einsum("gsk,gske,gskc->gsec", gates, mask, slot_onehot)
    return dispatch, combine


def einsum_moe(n_layers=2, seed=0):
    import flax.linen as nn

    class MoE(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.initializers.lecun_normal(batch_axis=(0,))
            wi = self.param("wi", init, (E, H, F))
            wo = self.param("wo", init, (E, F, H))
            probs = jax.nn.softmax(nn.Dense(E, use_bias=False, name="router")(x), axis=-1)
            dispatch, combine = _top_2_gating(probs, TOP_K, CAPACITY)
            expert_in = jnp.einsum("gsec,gsm->egcm", dispatch, x)
            h = nn.gelu(jnp.einsum("egcm,emf->egcf", expert_in, wi))
            expert_out = jnp.einsum("egcf,efm->egcm", h, wo)
            return jnp.einsum("gsec,egcm->gsm", combine, expert_out)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            b, s, _ = x.shape
            y = nn.RMSNorm()(x)
            q, k, v = (nn.Dense(H, use_bias=False, name=n)(y).reshape(b, s, NH, HD)
                       for n in ("q_proj", "k_proj", "v_proj"))
            x = x + nn.Dense(H, use_bias=False, name="o_proj")(attend(q, k, v).reshape(b, s, H))
            return x + MoE()(nn.RMSNorm()(x))  # groups: one per sequence

    class LM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(V, H)(ids)
            for _ in range(n_layers):
                x = Block()(x)
            return nn.Dense(V, use_bias=False, name="lm_head")(nn.RMSNorm()(x))

    return _linen_lm(LM(), seed)





def lstm_lm(n_layers=2, seed=0, hidden=H):
    """Flax linen's own recurrent layers as its examples use them: ``nn.RNN(nn.LSTMCell(H))``
    (a ``lax.scan`` over the sequence; the cell's gates from eight ``Dense`` layers: four on
    the input, four with bias on the hidden state), stacked, between an embedding and a head."""
    import flax.linen as nn

    class LM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(V, hidden)(ids)
            for i in range(n_layers):
                x = x + nn.RNN(nn.LSTMCell(hidden), name=f"lstm_{i}")(nn.LayerNorm()(x))
            return nn.Dense(V, use_bias=False, name="lm_head")(nn.LayerNorm()(x))

    return _linen_lm(LM(), seed)


PATTERNS = {f.__name__: f for f in (einsum_rotary, one_piece_split, einsum_moe, lstm_lm)}
