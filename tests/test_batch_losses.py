"""A loss defined over the batch (CLIP-style contrastive) evaluates to what it is, not to 0."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from redcoast import ConfigError, Deployer, Trainer

DIM, EMBED = 6, 4


def make_examples(n, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(n, DIM)).astype(np.float32)
    texts = images @ rng.normal(size=(DIM, DIM)).astype(np.float32) + 0.3 * rng.normal(size=(n, DIM))
    return [{"image": a, "text": b.astype(np.float32)} for a, b in zip(images, texts)]


def collate(examples):
    return {k: np.stack([e[k] for e in examples]) for k in ("image", "text")}


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {"image_tower": {"kernel": rng.normal(size=(DIM, EMBED)).astype(np.float32)},
            "text_tower": {"kernel": rng.normal(size=(DIM, EMBED)).astype(np.float32)}}


def clip_loss(params, batch):
    def embed(tower, x):
        e = x @ params[tower]["kernel"]
        return e / jnp.linalg.norm(e, axis=-1, keepdims=True)
    logits = 5.0 * embed("image_tower", batch["image"]) @ embed("text_tower", batch["text"]).T
    labels = jnp.arange(logits.shape[0])
    return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2


def loss_fn(rng, state, params, batch, is_training):
    return clip_loss(params, batch)


def trainer(n_model_shards=2, **kwargs):
    return Trainer(Deployer(jax_seed=0, n_model_shards=n_model_shards, verbose=False), collate,
                   None, loss_fn, init_params(), optax.sgd(0.1), **kwargs)


def by_hand(examples, global_batch):
    """The batch losses on one device, weighted by the rows of each batch (the last is smaller)."""
    params = init_params()
    total = sum(len(examples[i:i + global_batch]) * float(clip_loss(params, collate(examples[i:i + global_batch])))
                for i in range(0, len(examples), global_batch))
    return total / len(examples)


@pytest.mark.parametrize("eval_by", [None, "batch"])
def test_contrastive_eval_loss_equals_the_batch_loss_by_hand(eval_by):
    examples = make_examples(20)  # 4 data shards x 2 per device: batches of 8, 8 and 4
    got = trainer(eval_by=eval_by).eval_loss(examples, per_device_batch_size=2)
    expected = by_hand(examples, 8)
    assert expected > 0.1
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_per_example_evaluation_of_a_batch_loss_is_what_was_asked_for():
    examples = make_examples(16)
    assert trainer(eval_by="example").eval_loss(examples, per_device_batch_size=2) == 0.0


def test_a_smaller_set_than_one_batch_is_evaluated_whole():
    examples = make_examples(6)  # fewer than the global batch of 8
    got = trainer().eval_loss(examples, per_device_batch_size=2)
    np.testing.assert_allclose(got, float(clip_loss(init_params(), collate(examples))), rtol=1e-5)


def test_a_per_example_loss_keeps_the_exact_mean_over_examples():
    def squared(rng, state, params, batch, is_training):
        return jnp.mean((batch["image"] @ params["image_tower"]["kernel"]) ** 2)
    examples = make_examples(20)
    t = Trainer(Deployer(jax_seed=0, n_model_shards=2, verbose=False), collate, None, squared,
                init_params(), optax.sgd(0.1))
    per_example = [float(jnp.mean((e["image"] @ init_params()["image_tower"]["kernel"]) ** 2))
                   for e in examples]
    np.testing.assert_allclose(t.eval_loss(examples, 2), np.mean(per_example), rtol=1e-5)


def test_eval_by_is_checked():
    with pytest.raises(ConfigError, match="eval_by='per-batch'"):
        trainer(eval_by="per-batch")
