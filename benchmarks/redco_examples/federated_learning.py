"""redco's examples/faderated_learning/ (main.py, model_utils.py; FedAvg) in one file, adapted
only to run offline (see README.md): torchvision's MNIST and data_utils.get_dataset -> synthetic
digits (mnist.py's) split i.i.d. over the clients; fewer clients and rounds. Otherwise redco's
code, with its own import (Trainer.set_train_state per client, loss_fn(train_rng, ...),
pred_fn(pred_rng, batch, params), output_fn=lambda x: x.tolist())."""
import offline  # noqa: F401  (simulated devices, before jax)
from functools import partial
import fire
import tqdm
import numpy as np
from sklearn.metrics import confusion_matrix
import jax
import jax.numpy as jnp
from flax.core.frozen_dict import freeze
import flax.linen as nn
import optax

from mnist import synthetic_mnist

if offline.RUN_ON == "redco":
    from redco import Deployer, Trainer, Predictor
else:
    from redcoast import Deployer, Trainer, Predictor


def get_dataset(n_clients, seed=0):
    # offline: synthetic digits, split i.i.d. over the clients
    train = synthetic_mnist(128 * n_clients, seed=seed)
    test = synthetic_mnist(256, seed=seed + 1)
    for example in train + test:
        example['image'] = np.expand_dims(example['image'], axis=-1)
    return {i: train[i::n_clients] for i in range(n_clients)}, test


# ---------------------------------------------------------------- model_utils.py
class CNN(nn.Module):
    """
    A simple CNN model.
    Copied from https://github.com/google/flax/blob/main/examples/mnist/train.py
    """
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        x = nn.Dense(features=10)(x)
        return x


def collate_fn(examples):
    return {
        'images': np.stack([example['image'] for example in examples]),
        'labels': np.stack([example['label'] for example in examples])
    }


def loss_fn(train_rng, state, params, batch, is_training):
    logits = state.apply_fn({'params': params}, batch['images'])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch['labels'])
    return jnp.mean(loss)


def pred_fn(pred_rng, batch, params, model):
    return model.apply({'params': params}, batch['images']).argmax(axis=-1)


# ---------------------------------------------------------------- main.py
class FedAvgServer:
    def __init__(self, deployer, model, params, n_clients):
        self._deployer = deployer
        self._model = model
        self._params = freeze(params)
        self._n_clients = n_clients

        self._trainer = Trainer(
            deployer=self._deployer,
            collate_fn=collate_fn,
            apply_fn=self._model.apply,
            loss_fn=loss_fn,
            params=params,
            optimizer=optax.adam(learning_rate=0.))

        self._predictor = Predictor(
            deployer=self._deployer,
            collate_fn=collate_fn,
            pred_fn=partial(pred_fn, model=self._model),
            output_fn=lambda x: x.tolist())

    def train_client(self,
                     examples,
                     learning_rate,
                     per_device_batch_size,
                     n_epochs):
        self._trainer.set_train_state(
            apply_fn=self._model.apply,
            params=self._params,
            optimizer=optax.adam(learning_rate=learning_rate),
            step=0)

        self._trainer.fit(
            train_examples=examples,
            per_device_batch_size=per_device_batch_size,
            n_epochs=n_epochs)

        # not offline but for the comparison: redco's example returns trainer.params, which redco
        # 0.4.23's Trainer lacks (redcoast has it); get_params_to_save() works on both
        return self._trainer.get_params_to_save()

    def test(self, examples, per_device_batch_size):
        preds = self._predictor.predict(
            examples=examples,
            per_device_batch_size=per_device_batch_size,
            params=self._params)
        labels = [example['label'] for example in examples]

        acc = np.mean(np.array(preds) == np.array(labels))
        conf_mat = confusion_matrix(y_true=labels, y_pred=preds)

        return acc, conf_mat

    def run(self,
            n_rounds,
            n_clients_per_round,
            n_client_epochs_per_round,
            per_device_batch_size,
            eval_per_device_batch_size,
            learning_rate,
            client_train_datasets,
            eval_dataset):
        for round_idx in tqdm.trange(n_rounds, desc='Server Round'):
            round_client_idxes = np.random.choice(
                np.arange(self._n_clients), n_clients_per_round, replace=False)

            sum_client_params = jax.tree_util.tree_map(
                jnp.zeros_like, self._params)
            for client_idx in round_client_idxes:
                client_params = self.train_client(
                    examples=client_train_datasets[client_idx],
                    learning_rate=learning_rate,
                    per_device_batch_size=per_device_batch_size,
                    n_epochs=n_client_epochs_per_round)

                sum_client_params = jax.tree_util.tree_map(
                    lambda x, y: x + y, sum_client_params, client_params)

            self._params = jax.tree_util.tree_map(
                lambda x: x / n_clients_per_round, sum_client_params)

            acc, conf_mat = self.test(
                examples=eval_dataset,
                per_device_batch_size=eval_per_device_batch_size)

            print(f'Round {round_idx} finished.')
            print(f'Test accuracy: {acc}')
            print(f'Confusion matrix:\n {conf_mat}')
        return acc   # offline: for the comparison


def main(n_clients=4,
         n_rounds=3,
         n_clients_per_round=2,
         n_client_epochs_per_round=2,
         per_device_batch_size=4,
         eval_per_device_batch_size=8,
         learning_rate=0.001,
         jax_seed=42):
    np.random.seed(jax_seed)   # offline: the same clients on both libraries
    deployer = Deployer(jax_seed=jax_seed, verbose=False)

    client_train_datasets, eval_dataset = get_dataset(n_clients=n_clients)

    model = CNN()
    dummy_batch = collate_fn([eval_dataset[0]])
    params = model.init(deployer.gen_rng(), dummy_batch['images'])['params']

    server = FedAvgServer(
        deployer=deployer, model=model, params=params, n_clients=n_clients)

    acc = server.run(
        n_rounds=n_rounds,
        n_clients_per_round=n_clients_per_round,
        n_client_epochs_per_round=n_client_epochs_per_round,
        per_device_batch_size=per_device_batch_size,
        eval_per_device_batch_size=eval_per_device_batch_size,
        learning_rate=learning_rate,
        client_train_datasets=client_train_datasets,
        eval_dataset=eval_dataset)
    offline.report('acc', acc)


if __name__ == '__main__':
    fire.Fire(main)
