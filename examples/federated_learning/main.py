"""Federated averaging (FedAvg, McMahan et al., 2017) over simulated clients, trained with redcoast.

    python examples/federated_learning/main.py            # full run
    python examples/federated_learning/main.py --tiny     # CI-sized run

scikit-learn's bundled digits (8x8 images, 10 classes) are split over 10 clients the non-IID
way of the FedAvg paper: sorted by label, cut into 20 shards, two shards per client, so most
clients see only two digits. Each round every client starts from the global model, trains a few
local epochs on its own data, and the server averages the clients' parameters weighted by how
many examples each holds. One Trainer serves every client: ``trainer.set_params`` puts the global
model back in before each client's local training, without recompiling the step.

The metric is the global model's accuracy on held-out digits, beside the untrained model's and
that of one client trained alone for as many epochs (it knows two digits).

The MLP is small, so one copy per device (n_model_shards=1); a client's batches are split over
the 8 (simulated) devices as data parallelism.
"""

import argparse
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from redcoast import Deployer, Trainer
from redcoast.simulate import simulate_cpu_devices

# Simulate 8 devices on the CPU unless JAX_PLATFORMS names an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    simulate_cpu_devices(8)

PER_DEVICE_BATCH_SIZE = 2  # 16 examples per local step on 8 devices


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))


model = MLP()


def non_iid_clients(labels, n_clients, shards_per_client, rng):
    """Example indices of each client: label-sorted shards dealt out at random."""
    shards = np.array_split(np.argsort(labels, kind="stable"), n_clients * shards_per_client)
    dealt = rng.permutation(len(shards)).reshape(n_clients, shards_per_client)
    return [np.concatenate([shards[s] for s in row]) for row in dealt]


def collate_fn(examples):
    return {"pixels": np.stack([e["pixels"] for e in examples]),
            "label": np.array([e["label"] for e in examples], np.int32)}


def loss_fn(rng, state, params, batch, is_training):
    logits = state.apply_fn({"params": params}, batch["pixels"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"acc": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}


def pred_fn(rng, params, batch):
    return jnp.argmax(model.apply({"params": params}, batch["pixels"]), -1)


def accuracy(predictor, params, examples):
    preds = np.array(predictor.predict(examples, PER_DEVICE_BATCH_SIZE * 4, params))
    return float(np.mean(preds == np.array([e["label"] for e in examples])))


def local_training(trainer, global_params, examples, n_epochs, first_epoch, check_layout=False):
    """One client's update: from the global model, ``n_epochs`` over its own examples."""
    trainer.set_params(global_params)
    for epoch in range(first_epoch, first_epoch + n_epochs):
        trainer.train(examples, PER_DEVICE_BATCH_SIZE, epoch=epoch, check_layout=check_layout)
    return jax.device_get(trainer.params)


def weighted_average(client_params, weights):
    weights = np.asarray(weights, np.float64) / np.sum(weights)
    return jax.tree_util.tree_map(
        lambda *leaves: sum(w * leaf for w, leaf in zip(weights, leaves)).astype(leaves[0].dtype),
        *client_params)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a short run for CI")
    parser.add_argument("--metrics-out", help="write the final metrics here as JSON")
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch (Trainer.check_layout)")
    parser.add_argument("--workdir", default=os.path.join("workdir", "federated_learning"))
    parser.add_argument("--n-clients", type=int, default=10)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    args = parser.parse_args()
    n_rounds = 8 if args.tiny else 30

    digits = load_digits()
    pixels = (digits.data / 16.0).astype(np.float32)
    train_idx, test_idx = train_test_split(np.arange(len(pixels)), test_size=0.25,
                                           stratify=digits.target, random_state=0)
    as_examples = lambda idx: [{"pixels": pixels[i], "label": int(digits.target[i])} for i in idx]
    test_examples = as_examples(test_idx)
    clients = [as_examples(train_idx[c]) for c in non_iid_clients(
        digits.target[train_idx], args.n_clients, 2, np.random.default_rng(0))]

    deployer = Deployer(jax_seed=0, n_model_shards=1, workdir=args.workdir, verbose=False)
    initial = model.init(deployer.gen_rng(), jnp.zeros((1, 64)))["params"]
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=model.apply,
                      loss_fn=loss_fn, params=initial,
                      optimizer=optax.sgd(args.learning_rate, momentum=0.9))
    predictor = trainer.get_default_predictor(pred_fn=pred_fn)
    initial = jax.device_get(initial)

    acc_initial = accuracy(predictor, initial, test_examples)
    print(f"{len(clients)} clients, sizes {[len(c) for c in clients]}, digits per client "
          f"{[sorted({e['label'] for e in c}) for c in clients[:3]]}...")
    print(f"untrained model: test accuracy {acc_initial:.3f}")
    global_params = initial
    for round_idx in range(n_rounds):
        updates = [local_training(trainer, global_params, examples, args.local_epochs,
                                  first_epoch=round_idx * args.local_epochs,
                                  check_layout=args.check_layout)
                   for examples in clients]
        global_params = weighted_average(updates, [len(c) for c in clients])
        acc = accuracy(predictor, global_params, test_examples)
        print(f"round {round_idx + 1}/{n_rounds}: global model test accuracy {acc:.3f}")

    # the same number of epochs on one client's data alone
    alone = local_training(trainer, initial, clients[0], n_rounds * args.local_epochs, 0)
    acc_alone = accuracy(predictor, alone, test_examples)
    print(f"FedAvg global model {acc:.3f}; client 0 trained alone {acc_alone:.3f}; "
          f"untrained {acc_initial:.3f}")
    metrics = {"test_acc_fedavg": acc, "test_acc_single_client": acc_alone,
               "test_acc_initial": acc_initial, "rounds": n_rounds}
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)


if __name__ == "__main__":
    main()
