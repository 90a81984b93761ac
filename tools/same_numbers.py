"""The numbers a structural change must keep, bit for bit: run before and after, compare the lines.

    python tools/same_numbers.py

A small transformer LM on a 2 x 2 mesh (4 simulated CPU devices) with gradient accumulation,
evaluation every few steps, a checkpoint, and a resume from it in a second Trainer: prints the
SHA-256 of the final parameters and optimizer state, the logged metrics, and the resumed run's
parameters. Uses only redcoast's public names, so the same file runs on both sides of a move.
"""

import hashlib
import json
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from redcoast.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(4)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from redcoast import Deployer, Trainer  # noqa: E402

VOCAB, SEQ, D, HEADS = 64, 16, 32, 4


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=HEADS)(h, h, mask=nn.make_causal_mask(x[..., 0]))
        x = x + h
        h = nn.Dense(4 * D)(nn.LayerNorm()(x))
        return x + nn.Dense(D)(nn.gelu(h))


class LM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D)(ids) + self.param("pos", nn.initializers.normal(0.02), (SEQ, D))
        for _ in range(2):
            x = Block()(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def examples(n, seed):
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, size=n)
    return [{"ids": (s + np.arange(SEQ + 1) * (1 + s % 3)) % VOCAB} for s in start]


def collate_fn(batch):
    ids = np.stack([ex["ids"] for ex in batch]).astype(np.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def loss_fn(rng, state, params, batch, is_training):
    logits = state.apply_fn({"params": params}, batch["inputs"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return loss, {"acc": (jnp.argmax(logits, -1) == batch["targets"]).mean()}


def digest(tree):
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def _timeless(records):
    """A digest of logged records without what the clock measures (times, rates)."""
    def keep(name):
        return not any(word in str(name) for word in ("time", "per_s", "sec", "_s", "wall"))
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if keep(k)}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value
    text = json.dumps(strip(records), sort_keys=True, default=float)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def trainer(workdir):
    model = LM()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, SEQ), jnp.int32))["params"]
    deployer = Deployer(jax_seed=7, n_model_shards=2, workdir=workdir, verbose=False)
    return Trainer(deployer, collate_fn, model.apply, loss_fn, params,
                   optax.adamw(3e-3), accumulate_grad_batches=2)


def main():
    train, evals = examples(256, 1), examples(64, 2)
    fit = dict(per_device_batch_size=4, eval_examples=evals, eval_every_n_steps=4,
               save_every_n_steps=6)
    with tempfile.TemporaryDirectory() as whole, tempfile.TemporaryDirectory() as split:
        first = trainer(whole)
        history = first.fit(train, n_epochs=2, **fit)
        print("params", digest(first.state.params))
        print("opt_state", digest(first.state.opt_state))
        print("eval", json.dumps(first.evaluate(evals, per_device_batch_size=4), sort_keys=True,
                                 default=float))
        print("history", _timeless(history.by_step))
        with open(os.path.join(whole, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        print("metrics", _timeless(rows))
        # a run stopped at step 6 (its checkpoint), then resumed by a new Trainer to the end
        trainer(split).fit(train, n_epochs=2, max_steps=6, **fit)
        resumed = trainer(split)
        resumed.fit(train, n_epochs=2, **fit)
        print("resumed params", digest(resumed.state.params))
        print("resumed equal", digest(resumed.state.params) == digest(first.state.params))


if __name__ == "__main__":
    sys.exit(main())
