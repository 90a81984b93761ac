"""A CNN image classifier on scikit-learn's handwritten digits, data parallel over 8 devices.

    python examples/image_classification/main.py [--tiny] [--metrics-out metrics.json]

The 1,797 digits (8x8 grey images, 10 classes) ship with scikit-learn, so nothing is downloaded.
Each global batch is split over the data-parallel devices (8 simulated CPU devices when no
accelerator is present); the metric is held-out accuracy, beside chance (10%) and the untrained model.
"""

import argparse
import json
import os

from redcoast.simulate import simulate_cpu_devices

simulate_cpu_devices(8)  # CPU only, before JAX starts; an accelerator, if present, is used instead

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from redcoast import Deployer, Trainer  # noqa: E402


class CNN(nn.Module):
    """Two convolutions with average pooling, then two dense layers."""

    @nn.compact
    def __call__(self, x):
        for features in (32, 64):
            x = nn.relu(nn.Conv(features, kernel_size=(3, 3))(x))
            x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(128)(x.reshape((x.shape[0], -1))))
        return nn.Dense(10)(x)


def load_examples(seed=0, n_test=360):
    """The digits as {"image": [8, 8, 1] in [0, 1], "label": int}, split into train and test."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    examples = [{"image": x, "label": int(y)} for x, y in zip(images, digits.target)]
    order = np.random.default_rng(seed).permutation(len(examples))
    return [examples[i] for i in order[n_test:]], [examples[i] for i in order[:n_test]]


def collate_fn(examples):
    return {"images": np.stack([ex["image"] for ex in examples]),
            "labels": np.array([ex["label"] for ex in examples], np.int32)}


def loss_fn(rng, state, params, batch, is_training):
    logits = state.apply_fn({"params": params}, batch["images"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    return loss, {"acc": jnp.mean(logits.argmax(-1) == batch["labels"])}


def pred_fn(rng, params, batch):
    return CNN().apply({"params": params}, batch["images"]).argmax(-1)


def eval_metric_fn(examples, preds):
    return {"acc": float(np.mean([p == ex["label"] for ex, p in zip(examples, preds)]))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a CI-sized run (under a minute)")
    parser.add_argument("--metrics-out", help="write the final metrics here as JSON")
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch (Trainer.check_layout)")
    parser.add_argument("--workdir", default=os.path.join("workdir", "image_classification"))
    parser.add_argument("--per-device-batch-size", type=int, default=16)
    parser.add_argument("--n-epochs", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    args = parser.parse_args()
    n_epochs = args.n_epochs or (8 if args.tiny else 30)

    deployer = Deployer(jax_seed=42, n_model_shards=1, workdir=args.workdir)
    train_examples, test_examples = load_examples()
    model = CNN()
    params = model.init(deployer.gen_rng(), collate_fn(train_examples[:1])["images"])["params"]
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=model.apply,
                      loss_fn=loss_fn, params=params,
                      optimizer=optax.adam(args.learning_rate))

    predictor = trainer.get_default_predictor(pred_fn=pred_fn)

    def test_accuracy():
        preds = predictor.predict(test_examples, args.per_device_batch_size, trainer.params)
        return eval_metric_fn(test_examples, preds)["acc"]

    untrained = test_accuracy()
    trainer.fit(train_examples, per_device_batch_size=args.per_device_batch_size,
                n_epochs=n_epochs, eval_examples=test_examples, eval_predictor=predictor,
                eval_metric_fn=eval_metric_fn, resume=False, check_layout=args.check_layout)
    metrics = {"test_accuracy": test_accuracy(), "untrained_test_accuracy": untrained,
               "chance_accuracy": 0.1,
               "n_epochs": n_epochs, "n_data_shards": deployer.n_data_shards}
    deployer.log_info(json.dumps(metrics, indent=1), title="Final metrics")
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)


if __name__ == "__main__":
    main()
