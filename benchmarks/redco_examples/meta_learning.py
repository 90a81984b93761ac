"""redco's examples/meta_learning/main.py (MAML), adapted only to run offline (see README.md):
learn2learn's omniglot task sets -> synthetic 5-way 1-shot tasks (each class a random 28x28
pattern, its shots noisy copies), fewer tasks and epochs. Otherwise redco's code, with its own
import (its loss_fn(train_rng, ...), pred_fn(pred_rng, batch, params), eval_metric_fn(preds,
examples) and train_examples as a function of the epoch are kept as written)."""
import offline  # noqa: F401  (simulated devices, before jax)
from functools import partial
import fire
import numpy as np
import jax
import flax.linen as nn
import optax

if offline.RUN_ON == "redco":
    from redco import Deployer, Trainer, Predictor
else:
    from redcoast import Deployer, Trainer, Predictor


class SyntheticTaskset:
    # offline: stands for learn2learn's taskset.{train,validation}.sample()
    def __init__(self, n_ways, seed):
        self._rng = np.random.default_rng(seed)
        self._n_ways = n_ways

    def sample(self):
        patterns = self._rng.random((self._n_ways, 1, 28, 28)) > 0.5
        shots = [patterns + 0.3 * self._rng.standard_normal(patterns.shape) for _ in range(2)]
        images = np.stack(shots, axis=1).reshape((-1, 1, 28, 28)).astype(np.float32)
        labels = np.repeat(np.arange(self._n_ways), 2)
        order = self._rng.permutation(self._n_ways)
        return _Tensor(images), _Tensor(order[labels])


class _Tensor(np.ndarray):
    def __new__(cls, array):
        return np.asarray(array).view(cls)

    def numpy(self):
        return np.asarray(self)


class CNN(nn.Module):
    """
    A simple CNN model.
    Copied from https://github.com/google/flax/blob/main/examples/mnist/train.py
    """
    n_labels: int = 1

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
        x = nn.Dense(features=self.n_labels)(x)
        return x


def preprocess(l2l_example):
    return {
        'train': {
            'pixel_values': l2l_example[0][::2].numpy().transpose((0, 2, 3, 1)),
            'labels': l2l_example[1][::2].numpy()
        },
        'val': {
            'pixel_values': l2l_example[0][1::2].numpy().transpose(
                (0, 2, 3, 1)),
            'labels': l2l_example[1][1::2].numpy()
        },
    }


def collate_fn(examples):
    return {
        split: {
            key: np.stack([example[split][key] for example in examples])
            for key in examples[0][split].keys()
        } for split in ['train', 'val']
    }


def inner_loss_fn(params, batch, model):
    logits = model.apply({'params': params}, batch['pixel_values'])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch['labels']).mean()


def inner_step(params, model, inner_batch, inner_learning_rate, inner_n_steps):
    inner_optimizer = optax.sgd(learning_rate=inner_learning_rate)
    inner_opt_state = inner_optimizer.init(params)

    for _ in range(inner_n_steps):
        grads = jax.grad(inner_loss_fn)(params, inner_batch, model)
        updates, inner_opt_state = inner_optimizer.update(
            updates=grads, state=inner_opt_state, params=params)
        params = optax.apply_updates(params, updates)

    return params


def loss_fn(train_rng,
            state,
            params,
            batch,
            is_training,
            model,
            inner_learning_rate,
            inner_n_steps):
    def inner_maml_loss_fn(inner_batch_train, inner_batch_val):
        params_upd = inner_step(
            params=params,
            model=model,
            inner_batch=inner_batch_train,
            inner_learning_rate=inner_learning_rate,
            inner_n_steps=inner_n_steps)

        return inner_loss_fn(
            params=params_upd, batch=inner_batch_val, model=model)

    return jax.vmap(inner_maml_loss_fn)(batch['train'], batch['val']).mean()


def pred_fn(pred_rng,
            batch,
            params,
            model,
            inner_learning_rate,
            inner_n_steps):
    def inner_maml_pred_fn(inner_batch_train, inner_batch_val):
        params_upd = inner_step(
            params=params,
            model=model,
            inner_batch=inner_batch_train,
            inner_learning_rate=inner_learning_rate,
            inner_n_steps=inner_n_steps)

        return model.apply(
            {'params': params_upd}, inner_batch_val['pixel_values']
        ).argmax(axis=-1)

    return jax.vmap(inner_maml_pred_fn)(batch['train'], batch['val'])


def eval_metric_fn(preds, examples):
    preds = np.array(preds)
    labels = np.array([example['val']['labels'] for example in examples])
    return {'acc': np.mean(preds == labels).item()}


def main(n_ways=5,
         n_tasks_per_epoch=128,
         n_epochs=3,
         per_device_batch_size=2,
         learning_rate=0.003,
         inner_learning_rate=0.5,
         inner_n_steps=1,
         jax_seed=42):
    deployer = Deployer(jax_seed=jax_seed, n_model_shards=1)

    taskset = type('TaskSets', (), dict(train=SyntheticTaskset(n_ways, 0),
                                        validation=SyntheticTaskset(n_ways, 1)))

    model = CNN(n_labels=n_ways)
    dummy_inputs = taskset.train.sample()[0].numpy().transpose((0, 2, 3, 1))
    params = model.init(deployer.gen_rng(), dummy_inputs)['params']
    optimizer = optax.adamw(learning_rate=learning_rate)

    params_sharding_rules = deployer.get_sharding_rules(params)
    if params_sharding_rules is not None:
        deployer.log_info(
            info='\n'.join([str(t) for t in params_sharding_rules]),
            title='Sharding rules')

    trainer = Trainer(
        deployer=deployer,
        collate_fn=collate_fn,
        apply_fn=model.apply,
        loss_fn=partial(
            loss_fn,
            model=model,
            inner_learning_rate=inner_learning_rate,
            inner_n_steps=inner_n_steps),
        params=params,
        optimizer=optimizer,
        params_sharding_rules=params_sharding_rules)

    predictor = Predictor(
        deployer=deployer,
        collate_fn=collate_fn,
        pred_fn=partial(
            pred_fn,
            model=model,
            inner_learning_rate=inner_learning_rate,
            inner_n_steps=inner_n_steps),
        params_sharding_rules=params_sharding_rules)

    eval_examples = [
        preprocess(taskset.validation.sample())
        for _ in range(n_tasks_per_epoch)
    ]
    train_examples_fn = lambda epoch_idx: [
        preprocess(taskset.train.sample())
        for _ in range(n_tasks_per_epoch)
    ]
    trainer.fit(
        train_examples=train_examples_fn,
        per_device_batch_size=per_device_batch_size,
        n_epochs=n_epochs,
        eval_examples=eval_examples,
        eval_loss=False,
        eval_predictor=predictor,
        eval_metric_fn=eval_metric_fn)

    # added for the comparison: final accuracy on the eval tasks
    preds = predictor.predict(examples=eval_examples, params=trainer.state.params,
                              params_replicated=(trainer.mesh is None),
                              params_sharded=(trainer.mesh is not None),
                              per_device_batch_size=per_device_batch_size)
    offline.report('acc', eval_metric_fn(preds=preds, examples=eval_examples)['acc'])


if __name__ == '__main__':
    fire.Fire(main)
