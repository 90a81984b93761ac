"""A tiny decoder language model, its data and its three functions, shared by the tests."""

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB, WIDTH, HEADS, SEQ = 32, 32, 4, 12


class Block(nn.Module):
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train=False):
        b, t, d = x.shape
        h = nn.LayerNorm()(x)
        split = lambda y: y.reshape(b, t, HEADS, d // HEADS)
        # No key bias: its gradient is exactly zero in theory (softmax ignores it), so an adaptive
        # optimizer would amplify rounding noise in it and no two runs could agree.
        q = split(nn.Dense(d, name="query")(h))
        k = split(nn.Dense(d, use_bias=False, name="key")(h))
        v = split(nn.Dense(d, name="value")(h))
        mask = jnp.tril(jnp.ones((t, t), bool))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // HEADS)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        att = nn.Dropout(self.dropout, deterministic=not train)(att)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
        x = x + nn.Dense(d, name="out")(y)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(d, name="fc_out")(nn.gelu(nn.Dense(4 * d, name="fc_in")(h)))


class TinyLM(nn.Module):
    n_layers: int = 2
    dropout: float = 0.0

    @nn.compact
    def __call__(self, ids, train=False):
        x = nn.Embed(VOCAB, WIDTH)(ids) + self.param("pos", nn.initializers.normal(0.02), (SEQ, WIDTH))[:ids.shape[1]]
        for i in range(self.n_layers):
            x = Block(self.dropout, name=f"block_{i}")(x, train)
        return nn.Dense(VOCAB, name="head")(nn.LayerNorm()(x))


def make_model(dropout=0.0, seed=0):
    model = TinyLM(dropout=dropout)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, SEQ), jnp.int32))["params"]
    return model, params


def make_examples(n, seed=0):
    """Sequences that count up modulo VOCAB from a random start: easy to learn."""
    starts = np.random.RandomState(seed).randint(0, VOCAB, n)
    return [{"ids": (s + np.arange(SEQ + 1)) % VOCAB} for s in starts]


def collate_fn(examples):
    return {"ids": np.stack([e["ids"] for e in examples]).astype(np.int32)}


def loss_fn(rng, state, params, batch, is_training):
    ids = batch["ids"]
    logits = state.apply_fn({"params": params}, ids[:, :-1], train=is_training, rngs={"dropout": rng})
    labels = ids[:, 1:]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()
    return loss, {"acc": jnp.mean(logits.argmax(-1) == labels)}


def ignore_index_collate(examples):
    """``collate_fn``'s ids with next-token labels whose last 3 are padding, marked -100 as
    PyTorch's ignore_index (a NaN in JAX's cross-entropy, masked or not)."""
    ids = collate_fn(examples)["ids"]
    labels, mask = ids[:, 1:].copy(), np.ones(ids[:, 1:].shape, np.float32)
    labels[:, -3:], mask[:, -3:] = -100, 0.0
    return {"ids": ids, "labels": labels, "mask": mask}


def masked_loss(rng, state, params, batch, is_training):
    """Cross-entropy where ``mask`` is 1, as a PyTorch user writes it over -100 labels."""
    logits = state.apply_fn({"params": params}, batch["ids"][:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return jnp.sum(losses * batch["mask"]) / jnp.sum(batch["mask"])


def reference_train(model, params, optimizer, batches):
    """A hand-written single-device loop (no redcoast): the independent answer."""
    state = types.SimpleNamespace(apply_fn=model.apply)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: loss_fn(jax.random.PRNGKey(0), state, p, batch, True)[0])(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for batch in batches:
        params, opt_state = step(params, opt_state, batch)
    return params


def example_losses(model, params, examples):
    """Each example's loss on its own, on one device."""
    state = types.SimpleNamespace(apply_fn=model.apply)
    f = jax.jit(lambda p, b: loss_fn(jax.random.PRNGKey(0), state, p, b, False)[0])
    return np.array([float(f(params, collate_fn([e]))) for e in examples])


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    flat_a = jax.tree_util.tree_leaves_with_path(a)
    flat_b = jax.tree_util.tree_leaves(b)
    assert len(flat_a) == len(flat_b)
    for (path, x), y in zip(flat_a, flat_b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))
