"""Differentially private training (DP-SGD) of a CNN on scikit-learn's handwritten digits.

    python examples/dp_sgd/main.py [--tiny] [--epsilon 4] [--metrics-out metrics.json]

DP-SGD (Abadi et al., 2016) bounds what the trained model reveals about any one training example:
every step samples each example independently with probability q (Poisson sampling), clips each
example's gradient to an L2 norm of at most C, sums them and adds Gaussian noise of standard
deviation sigma * C. The privacy budget (epsilon at a given delta) of all the steps together comes
from a maintained accountant (Google's dp-accounting, Renyi DP); sigma is calibrated with it so
that the run spends exactly the target epsilon.

On redcoast: the per-example gradients come from a custom ``train_step_fn`` (``jax.vmap`` of
``jax.grad`` over the batch, which stays sharded over the data-parallel devices); clipping, the sum
and the noise are optax's ``differentially_private_aggregate``, the first link of the optimizer.
Poisson batches vary in size, so each is padded to a fixed size with examples of weight 0, whose
gradient is exactly zero; ``fit(shuffle=False)`` with ``train_examples`` a function of the epoch
keeps every padded batch together. (The epsilon covers the trained parameters; the training loss
the Trainer logs is computed on private batches without noise, so keep such logs private too.)
"""

import argparse
import json
import math
import os

from redcoast.simulate import simulate_cpu_devices

simulate_cpu_devices(8)  # CPU only, before JAX starts; an accelerator, if present, is used instead

import dp_accounting  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from redcoast import Deployer, Trainer  # noqa: E402


class CNN(nn.Module):
    """A small CNN: few parameters keep the noise, which grows with their number, small; tanh
    (a bounded activation) trains better than relu under clipping and noise (Papernot et al., 2021)."""

    @nn.compact
    def __call__(self, x):
        for features in (16, 32):
            x = nn.tanh(nn.Conv(features, kernel_size=(3, 3))(x))
            x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def load_examples(seed=0, n_test=360):
    """The digits as {"image": [8, 8, 1] in [0, 1], "label": int}, split into train and test."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    examples = [{"image": x, "label": int(y)} for x, y in zip(images, digits.target)]
    order = np.random.default_rng(seed).permutation(len(examples))
    return [examples[i] for i in order[n_test:]], [examples[i] for i in order[:n_test]]


PADDING = {"image": np.zeros((8, 8, 1), np.float32), "label": 0, "weight": 0.0}


def poisson_batches(examples, q, n_steps, batch_size, seed):
    """``n_steps`` Poisson samples of ``examples`` (each example in each with probability q),
    each padded to ``batch_size`` examples, one after the other; and how many were truncated."""
    rng = np.random.default_rng(seed)
    out, truncated = [], 0
    for _ in range(n_steps):
        chosen = np.flatnonzero(rng.random(len(examples)) < q)
        truncated += max(0, len(chosen) - batch_size)
        out += [examples[i] for i in chosen[:batch_size]]
        out += [PADDING] * (batch_size - min(len(chosen), batch_size))
    return out, truncated


def collate_fn(examples):
    return {"images": np.stack([ex["image"] for ex in examples]),
            "labels": np.array([ex["label"] for ex in examples], np.int32),
            "weight": np.array([ex.get("weight", 1.0) for ex in examples], np.float32)}


def loss_fn(rng, state, params, batch, is_training):
    """Cross-entropy over the real examples (weight 1); padding (weight 0) adds nothing."""
    logits = state.apply_fn({"params": params}, batch["images"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    n_real = jnp.maximum(batch["weight"].sum(), 1.0)
    correct = logits.argmax(-1) == batch["labels"]
    return (batch["weight"] * losses).sum() / n_real, {
        "acc": (batch["weight"] * correct).sum() / n_real}


def dp_train_step(state, batch, rng):
    """One DP-SGD update: a gradient per example (batch axis first, sharded over the data-parallel
    devices), handed to the optimizer, whose first link clips, sums and adds the noise."""
    def example_loss(params, example):
        one = jax.tree_util.tree_map(lambda x: x[None], example)
        return loss_fn(rng, state, params, one, True)[0]

    losses, grads = jax.vmap(jax.value_and_grad(example_loss), in_axes=(None, 0))(
        state.params, batch)
    n_real = batch["weight"].sum()
    return state.apply_gradients(grads=grads), {"loss": losses.sum() / jnp.maximum(n_real, 1.0),
                                                "batch_size": n_real}


# Renyi orders for the accountant (orders below 1.5 add nothing here and fail to converge)
RDP_ORDERS = [1.5 + i / 4 for i in range(38)] + list(range(11, 65)) + [128, 256]


def poisson_gaussian_event(q, noise_multiplier, n_steps):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(noise_multiplier)),
        n_steps)


def calibrate_noise(epsilon, delta, q, n_steps):
    """The smallest noise multiplier sigma whose n_steps Poisson-sampled steps spend ``epsilon``."""
    return dp_accounting.calibrate_dp_mechanism(
        lambda: dp_accounting.rdp.RdpAccountant(RDP_ORDERS),
        lambda sigma: poisson_gaussian_event(q, sigma, n_steps), epsilon, delta)


def epsilon_spent(noise_multiplier, delta, q, n_steps):
    accountant = dp_accounting.rdp.RdpAccountant(RDP_ORDERS)
    return accountant.compose(poisson_gaussian_event(q, noise_multiplier, n_steps)).get_epsilon(delta)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a CI-sized run (under a minute)")
    parser.add_argument("--metrics-out", help="write the final metrics here as JSON")
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch (Trainer.check_layout)")
    parser.add_argument("--workdir", default=os.path.join("workdir", "dp_sgd"))
    parser.add_argument("--epsilon", type=float, default=4.0, help="the privacy budget to spend")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--l2-norm-clip", type=float, default=1.0)
    parser.add_argument("--expected-batch-size", type=int, default=128)
    parser.add_argument("--n-epochs", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=1.0)
    args = parser.parse_args()
    n_epochs = args.n_epochs or (10 if args.tiny else 20)

    deployer = Deployer(jax_seed=42, n_model_shards=1, workdir=args.workdir)
    train_examples, test_examples = load_examples()
    q = args.expected_batch_size / len(train_examples)
    steps_per_epoch = round(1 / q)  # one pass over the data in expectation
    n_steps = n_epochs * steps_per_epoch
    # room for a Poisson batch 4 standard deviations above its mean, in whole rows of devices
    rows = deployer.n_data_shards
    mean = args.expected_batch_size
    batch_size = rows * math.ceil((mean + 4 * mean ** 0.5) / rows)
    sigma = calibrate_noise(args.epsilon, args.delta, q, n_steps)
    deployer.log_info(f"q = {q:.4f}, {n_steps} steps, noise multiplier sigma = {sigma:.4f} "
                      f"for epsilon = {args.epsilon} at delta = {args.delta}", title="DP-SGD")
    truncated = {}  # epoch -> examples dropped from oversized batches (expected: none)

    def examples_of_epoch(epoch):  # the same batches whenever asked (fit may ask twice)
        batches, truncated[epoch] = poisson_batches(train_examples, q, steps_per_epoch, batch_size,
                                                    seed=(deployer.jax_seed, epoch))
        return batches

    model = CNN()
    params = model.init(deployer.gen_rng(), collate_fn(train_examples[:1])["images"])["params"]
    # the learning rate decays linearly to 0, so that the last updates, and their noise, are small
    lr_schedule_fn = deployer.get_lr_schedule_fn(
        train_size=steps_per_epoch * batch_size, per_device_batch_size=batch_size // rows,
        n_epochs=n_epochs, learning_rate=args.learning_rate)
    noise_key = jax.random.wrap_key_data(deployer.gen_rng())  # optax wants a typed key
    optimizer = optax.chain(
        optax.contrib.differentially_private_aggregate(args.l2_norm_clip, sigma, key=noise_key),
        optax.sgd(lr_schedule_fn, momentum=0.9))
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=model.apply,
                      loss_fn=loss_fn, params=params, optimizer=optimizer,
                      lr_schedule_fn=lr_schedule_fn, train_step_fn=dp_train_step)

    def test_accuracy():
        return trainer.evaluate(test_examples, per_device_batch_size=batch_size // rows)["acc"]

    untrained = test_accuracy()
    trainer.fit(examples_of_epoch, per_device_batch_size=batch_size // rows, n_epochs=n_epochs,
                eval_examples=test_examples, shuffle=False, resume=False,
                check_layout=args.check_layout)
    metrics = {"test_accuracy": test_accuracy(), "untrained_test_accuracy": untrained,
               "chance_accuracy": 0.1, "epsilon": epsilon_spent(sigma, args.delta, q, n_steps),
               "target_epsilon": args.epsilon, "delta": args.delta, "noise_multiplier": sigma,
               "l2_norm_clip": args.l2_norm_clip, "sampling_rate": q, "n_steps": n_steps,
               "truncated_examples": int(sum(truncated.values()))}
    deployer.log_info(json.dumps(metrics, indent=1), title="Final metrics")
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)


if __name__ == "__main__":
    main()
