"""redco's examples/differential_private_training/main.py and dp_utils.py (one file), adapted
only to run offline (see README.md): torchvision's MNIST download -> synthetic 28x28 digits
(mnist.py's); smaller sizes. Its custom step, dp_train_step(rng, state, batch, loss_fn,
lr_schedule_fn, mesh, compute_dtype), is redco's form and is kept as written."""
import offline  # noqa: F401  (simulated devices, before jax)
from functools import partial
import fire
import numpy as np
import jax
import jax.numpy as jnp
from flax import linen as nn
import optax
from jax.example_libraries.optimizers import l2_norm
from dp_accounting import dp_event
from dp_accounting import rdp

from mnist import synthetic_mnist

if offline.RUN_ON == "redco":
    from redco import Deployer, Trainer, Predictor
else:
    from redcoast import Deployer, Trainer, Predictor


# ---------------------------------------------------------------- dp_utils.py
def get_noise_multiplier_by_epsilon(epsilon,
                                    steps,
                                    num_examples,
                                    batch_size,
                                    target_delta=1e-5,
                                    low=0.,
                                    high=100.,
                                    n_attempts=100):
    def _compute_epsilon(noise_multiplier):
        return compute_epsilon(
            steps=steps,
            num_examples=num_examples,
            batch_size=batch_size,
            noise_multiplier=noise_multiplier,
            target_delta=target_delta)

    for _ in range(n_attempts):
        mid = (low + high) / 2.
        if _compute_epsilon(noise_multiplier=mid) > epsilon:
            low = mid
        else:
            high = mid

    noise_multiplier = (low + high) / 2.
    return noise_multiplier, _compute_epsilon(noise_multiplier=noise_multiplier)


def compute_epsilon(
        steps, num_examples, batch_size, noise_multiplier, target_delta):
    if num_examples * target_delta > 1.:
        print('Your delta might be too high.')
    q = batch_size / float(num_examples)
    orders = list(jnp.linspace(1.1, 10.9, 99)) + list(range(11, 64))
    accountant = rdp.rdp_privacy_accountant.RdpAccountant(orders)
    accountant.compose(
        dp_event.PoissonSampledDpEvent(
            q, dp_event.GaussianDpEvent(noise_multiplier)), steps)
    return accountant.get_epsilon(target_delta)


def dp_train_step(
        rng, state, batch, loss_fn, lr_schedule_fn, mesh, compute_dtype):
    def loss_and_grads(rng_, batch_):
        return jax.value_and_grad(
            lambda params: loss_fn(
                rng=rng_,
                state=state,
                params=params,
                batch=batch_,
                is_training=True)
        )(jax.tree.map(lambda x: x.astype(compute_dtype), state.params))

    def loss_and_per_sample_grads(rng_, batch_):
        batch_ = jax.tree.map(lambda x: x[:, None], batch_)
        loss, grads = jax.vmap(lambda b: loss_and_grads(rng_, b))(batch_)

        return loss.mean(), grads

    if mesh is None:
        loss, grads = loss_and_per_sample_grads(rng, batch)
        grads = jax.lax.pmean(grads, axis_name='dp')
    else:
        loss, grads = jax.vmap(loss_and_per_sample_grads)(
            jax.random.split(rng, num=mesh.shape['dp']), batch)
        loss = jnp.mean(loss)
        grads = jax.tree.map(lambda x: jnp.mean(x, axis=0), grads)

    new_state = state.apply_gradients(grads=jax.tree.map(
        lambda grad, param: grad.astype(param.dtype), grads, state.params))

    metrics = {'loss': loss, 'step': state.step, 'grad_norm': l2_norm(grads)}
    if lr_schedule_fn is not None:
        metrics['lr'] = lr_schedule_fn(state.step)
    if mesh is None:
        metrics = jax.lax.pmean(metrics, axis_name='dp')

    return new_state, metrics


# ---------------------------------------------------------------- main.py
class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=64, dtype=jnp.float16)(x)
        x = nn.relu(x)
        x = nn.Dense(features=10)(x)
        return x


def collate_fn(examples):
    images = np.stack(
        [np.array(example['image'])[:, :, None] for example in examples])
    labels = np.array([example['label'] for example in examples])

    return {'images': images, 'labels': labels}


def loss_fn(rng, state, params, batch, is_training):
    logits = state.apply_fn({'params': params}, batch['images'])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch['labels']).mean()


def pred_fn(rng, params, batch, model):
    return model.apply({'params': params}, batch['images']).argmax(axis=-1)


def eval_metric_fn(examples, preds):
    preds = np.array(preds)
    labels = np.array([example['label'] for example in examples])
    return {'acc': np.mean(preds == labels).item()}


def main(global_batch_size=64,
         per_device_batch_size=8,
         n_epochs=3,
         learning_rate=1e-3,
         epsilon=4.,
         l2_norm_clip=1.5,
         jax_seed=42):
    deployer = Deployer(jax_seed=jax_seed, workdir='./workdir_dp')

    dataset = {
        'train': synthetic_mnist(1024, seed=0),
        'test': synthetic_mnist(256, seed=1),
    }

    model = CNN()
    dummy_batch = collate_fn(examples=[dataset['train'][0]])
    params = model.init(deployer.gen_rng(), dummy_batch['images'])['params']

    noise_multiplier, epsilon = get_noise_multiplier_by_epsilon(
        epsilon=epsilon,
        steps=len(dataset['train']) * n_epochs // global_batch_size,
        num_examples=len(dataset['train']),
        batch_size=global_batch_size)
    deployer.log_info(noise_multiplier, title='Noise Multiplier')
    deployer.log_info(epsilon, title='Epsilon')

    accumulate_grad_batches = deployer.get_accumulate_grad_batches(
        global_batch_size=global_batch_size,
        per_device_batch_size=per_device_batch_size)
    # optax.MultiSteps hasn't supported optax.differentially_private_aggregate
    assert accumulate_grad_batches == 1

    optimizer = optax.chain(
        optax.contrib.differentially_private_aggregate(
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier,
            seed=jax_seed),
        optax.adamw(learning_rate=learning_rate)
    )

    trainer = Trainer(
        deployer=deployer,
        collate_fn=collate_fn,
        apply_fn=model.apply,
        loss_fn=loss_fn,
        params=params,
        optimizer=optimizer,
        accumulate_grad_batches=accumulate_grad_batches,
        train_step_fn=dp_train_step)

    predictor = Predictor(
        deployer=deployer,
        collate_fn=collate_fn,
        pred_fn=partial(pred_fn, model=model))

    trainer.fit(
        train_examples=dataset['train'],
        per_device_batch_size=per_device_batch_size,
        n_epochs=n_epochs,
        eval_examples=dataset['test'],
        eval_predictor=predictor,
        eval_metric_fn=eval_metric_fn)

    # added for the comparison: final eval loss and accuracy
    offline.report('eval_loss', trainer.eval_loss(
        examples=dataset['test'], per_device_batch_size=per_device_batch_size))
    preds = predictor.predict(examples=dataset['test'], params=trainer.state.params,
                              params_replicated=(trainer.mesh is None),
                              params_sharded=(trainer.mesh is not None),
                              per_device_batch_size=per_device_batch_size)
    offline.report('acc', eval_metric_fn(dataset['test'], preds)['acc'])


if __name__ == '__main__':
    fire.Fire(main)
