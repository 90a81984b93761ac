"""MAML (Finn et al., 2017) on few-shot sine-wave regression, trained with redcoast.

    python examples/meta_learning/main.py            # full run
    python examples/meta_learning/main.py --tiny     # CI-sized run

Every task is one sine wave y = A sin(x + phase) (A in [0.1, 5], phase in [0, pi]) seen through
10 support points; the model adapts to it with a few plain gradient steps on the support points
and is scored on 10 query points of the same wave. MAML trains the starting point of that
adaptation: the loss is the query loss *after* the inner steps, differentiated through them
(second-order MAML; ``--first-order`` drops the second derivatives). The metric is the
post-adaptation query MSE on held-out waves, for the meta-trained model and for the same network
before meta-training (adapted the same way).

Each example is a task; a batch holds tasks, split over the 8 (simulated) devices as data
parallelism. The MLP is tiny, so one copy per device (n_model_shards=1) is the right layout.
"""

import argparse
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from redcoast import Deployer, Trainer
from redcoast.simulate import simulate_cpu_devices

# Simulate 8 devices on the CPU unless JAX_PLATFORMS names an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    simulate_cpu_devices(8)


class MLP(nn.Module):
    """x -> y with two hidden layers of 40 units, as in the MAML paper."""

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.relu(nn.Dense(40)(x))
        return nn.Dense(1)(x)


model = MLP()


def sample_tasks(rng, n_tasks, n_shots):
    """``n_tasks`` sine waves, each with ``n_shots`` support and ``n_shots`` query points."""
    amplitude = rng.uniform(0.1, 5.0, (n_tasks, 1, 1))
    phase = rng.uniform(0.0, np.pi, (n_tasks, 1, 1))
    x = rng.uniform(-5.0, 5.0, (n_tasks, 2 * n_shots, 1))
    y = amplitude * np.sin(x + phase)
    x, y = x.astype(np.float32), y.astype(np.float32)
    return [{"support_x": x[i, :n_shots], "support_y": y[i, :n_shots],
             "query_x": x[i, n_shots:], "query_y": y[i, n_shots:]} for i in range(n_tasks)]


def collate_fn(tasks):
    """Tasks -> arrays of shape (tasks, points, 1) for the support and query sets."""
    return {key: np.stack([task[key] for task in tasks]) for key in tasks[0]}


def mse(params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)


def adapt(params, x, y, inner_lr, inner_steps, first_order):
    """The inner loop: ``inner_steps`` SGD steps on one task's support set."""
    for _ in range(inner_steps):
        grads = jax.grad(mse)(params, x, y)
        if first_order:  # first-order MAML: no derivative through the inner gradient
            grads = jax.lax.stop_gradient(grads)
        params = jax.tree_util.tree_map(lambda p, g: p - inner_lr * g, params, grads)
    return params


def make_loss_fn(inner_lr, inner_steps, first_order):
    def loss_fn(rng, state, params, batch, is_training):
        """Mean over the batch's tasks of the query MSE after adapting on the support set."""
        def task_loss(sx, sy, qx, qy):
            return mse(adapt(params, sx, sy, inner_lr, inner_steps, first_order), qx, qy)

        losses = jax.vmap(task_loss)(batch["support_x"], batch["support_y"],
                                     batch["query_x"], batch["query_y"])
        return jnp.mean(losses)
    return loss_fn


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a short run for CI")
    parser.add_argument("--metrics-out", help="write the final metrics here as JSON")
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch (Trainer.check_layout)")
    parser.add_argument("--workdir", default=os.path.join("workdir", "meta_learning"))
    parser.add_argument("--first-order", action="store_true", help="first-order MAML")
    parser.add_argument("--n-shots", type=int, default=10)
    parser.add_argument("--inner-lr", type=float, default=0.01)
    parser.add_argument("--inner-steps", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    args = parser.parse_args()
    n_epochs, tasks_per_epoch = (8, 4096) if args.tiny else (40, 8192)
    per_device_batch_size = 4  # tasks per device: 32 tasks per meta-update on 8 devices

    deployer = Deployer(jax_seed=0, n_model_shards=1, workdir=args.workdir)
    params = model.init(deployer.gen_rng(), jnp.zeros((1, 1)))["params"]
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=model.apply,
                      loss_fn=make_loss_fn(args.inner_lr, args.inner_steps, args.first_order),
                      params=params, optimizer=optax.adam(args.learning_rate))

    # held-out waves, and fresh training waves every epoch
    eval_tasks = sample_tasks(np.random.default_rng(12345), 512, args.n_shots)
    train_tasks = lambda epoch: sample_tasks(np.random.default_rng(epoch), tasks_per_epoch,
                                             args.n_shots)
    before = trainer.eval_loss(eval_tasks, per_device_batch_size)
    predict_zero = float(np.mean([np.mean(task["query_y"] ** 2) for task in eval_tasks]))
    deployer.log_info(f"held-out query MSE after adaptation, before meta-training: {before:.3f}")
    trainer.fit(train_tasks, per_device_batch_size=per_device_batch_size, n_epochs=n_epochs,
                eval_examples=eval_tasks, resume=False, check_layout=args.check_layout)
    after = trainer.eval_loss(eval_tasks, per_device_batch_size)
    deployer.log_info(f"held-out query MSE after adaptation: {after:.3f} (before meta-training "
                      f"{before:.3f})")
    deployer.log_info(f"(predicting 0 everywhere: {predict_zero:.3f})")
    metrics = {"query_mse_before": before, "query_mse_after": after, "query_mse_zero": predict_zero,
               "first_order": args.first_order, "meta_updates": trainer.step}
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)


if __name__ == "__main__":
    main()
