"""Proximal policy optimisation (PPO, Schulman et al., 2017) on CartPole-v1, trained with redcoast.

    python examples/ppo/main.py            # full run
    python examples/ppo/main.py --tiny     # CI-sized run

Each iteration runs the current policy in 8 copies of gymnasium's CartPole for 128 steps (1024
transitions), estimates advantages with GAE, and trains the clipped surrogate objective (with a
value loss and an entropy bonus) for a few epochs of shuffled minibatches over those transitions
with ``trainer.train``: the rollout is the epoch's examples, so every iteration trains on fresh
data with the same compiled step. Acting uses a jitted policy on a host copy of the parameters.

The metric is the trained policy's mean episode return (greedy, 500 at most), beside a uniformly
random policy's (about 22) and the return of the first iteration's episodes.

Actor and critic are small MLPs, so one copy per device (n_model_shards=1); minibatches are split
over the 8 (simulated) devices as data parallelism.
"""

import argparse
import json
import os

import flax.linen as nn
import gymnasium as gym
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

N_ENVS, N_STEPS = 8, 128          # 1024 transitions per iteration
GAMMA, GAE_LAMBDA, CLIP = 0.99, 0.95, 0.2
PER_DEVICE_BATCH_SIZE = 32        # 256 transitions per update on 8 devices
N_EPOCHS_PER_ITERATION = 4


class ActorCritic(nn.Module):
    """Observation -> (action logits, state value), from two separate tanh MLPs."""
    n_actions: int

    @nn.compact
    def __call__(self, obs):
        def mlp(x, out, name):
            for i in range(2):
                x = nn.tanh(nn.Dense(64, name=f"{name}_{i}")(x))
            return nn.Dense(out, name=f"{name}_out")(x)
        return mlp(obs, self.n_actions, "actor"), mlp(obs, 1, "critic")[..., 0]


def collate_fn(transitions):
    return {key: np.stack([t[key] for t in transitions]) for key in transitions[0]}


def loss_fn(rng, state, params, batch, is_training):
    """Clipped surrogate + 0.5 x value error - 0.01 x entropy, on one minibatch."""
    logits, values = state.apply_fn({"params": params}, batch["obs"])
    log_probs = jax.nn.log_softmax(logits)
    log_prob = jnp.take_along_axis(log_probs, batch["action"][:, None], -1)[:, 0]
    adv = batch["advantage"]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ratio = jnp.exp(log_prob - batch["log_prob"])
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - CLIP, 1 + CLIP) * adv).mean()
    value_loss = jnp.mean((values - batch["return"]) ** 2)
    entropy = -jnp.mean(jnp.sum(jnp.exp(log_probs) * log_probs, -1))
    loss = -surrogate + 0.5 * value_loss - 0.01 * entropy
    return loss, {"value_loss": value_loss, "entropy": entropy,
                  "clip_frac": jnp.mean(jnp.abs(ratio - 1) > CLIP)}


def make_policy(model):
    @jax.jit
    def policy(params, obs, rng, greedy=False):
        logits, value = model.apply({"params": params}, obs)
        action = jnp.where(greedy, jnp.argmax(logits, -1), jax.random.categorical(rng, logits))
        log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], -1)[:, 0]
        return action, log_prob, value
    return policy


def rollout(envs, obs, policy, params, rng, episode_returns, running):
    """N_STEPS steps in every env; returns the transitions (with GAE) and the next observations.
    Finished episodes' returns are appended to ``episode_returns``."""
    steps = []
    for _ in range(N_STEPS):
        rng, key = jax.random.split(rng)
        action, log_prob, value = jax.device_get(policy(params, obs, key))
        results = [env.step(int(a)) for env, a in zip(envs, action)]
        next_obs = np.stack([r[0] for r in results]).astype(np.float32)
        reward = np.array([r[1] for r in results], np.float32)
        terminated = np.array([r[2] for r in results])
        truncated = np.array([r[3] for r in results])
        running += reward
        if truncated.any():  # cut by the time limit, not failed: bootstrap from the last state
            reward += GAMMA * np.where(truncated & ~terminated, jax.device_get(
                policy(params, next_obs, key)[2]), 0.0)
        steps.append((obs, action, log_prob, value, reward, terminated | truncated))
        for i in np.flatnonzero(terminated | truncated):
            episode_returns.append(float(running[i]))
            running[i] = 0.0
            next_obs[i] = envs[i].reset()[0]
        obs = next_obs
    last_value = jax.device_get(policy(params, obs, rng)[2])
    transitions, advantage = [], np.zeros(len(envs), np.float32)
    for obs_t, action, log_prob, value, reward, done in reversed(steps):  # GAE, backwards
        delta = reward + GAMMA * last_value * (1 - done) - value
        advantage = delta + GAMMA * GAE_LAMBDA * (1 - done) * advantage
        last_value = value
        transitions += [{"obs": obs_t[i], "action": np.int32(action[i]),
                         "log_prob": log_prob[i], "advantage": advantage[i],
                         "return": advantage[i] + value[i]} for i in range(len(envs))]
    return transitions, obs


def evaluate(envs, act, seed):
    """Mean return of one episode in each env, actions from ``act(obs)``."""
    obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]).astype(np.float32)
    returns, done = np.zeros(len(envs)), np.zeros(len(envs), bool)
    while not done.all():
        for i, a in enumerate(act(obs)):
            if not done[i]:
                obs[i], reward, terminated, truncated, _ = envs[i].step(int(a))
                returns[i] += reward
                done[i] = terminated or truncated
    return float(returns.mean())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a short run for CI")
    parser.add_argument("--metrics-out", help="write the final metrics here as JSON")
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch (Trainer.check_layout)")
    parser.add_argument("--workdir", default=os.path.join("workdir", "ppo"))
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    args = parser.parse_args()
    n_iterations = 20 if args.tiny else 60

    envs = [gym.make("CartPole-v1") for _ in range(N_ENVS)]
    model = ActorCritic(n_actions=envs[0].action_space.n)
    deployer = Deployer(jax_seed=0, n_model_shards=1, workdir=args.workdir, verbose=False)
    params = model.init(deployer.gen_rng(), jnp.zeros((1, 4)))["params"]
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=model.apply,
                      loss_fn=loss_fn, params=params,
                      optimizer=optax.chain(optax.clip_by_global_norm(0.5),
                                            optax.adam(args.learning_rate)))
    policy = make_policy(model)
    coin = np.random.default_rng(0)
    random_return = evaluate(envs, lambda obs: coin.integers(2, size=len(obs)), seed=1000)
    print(f"random policy: mean return {random_return:.1f}")

    obs = np.stack([env.reset(seed=i)[0] for i, env in enumerate(envs)]).astype(np.float32)
    rng, returns, running, first_returns = deployer.gen_rng(), [], np.zeros(N_ENVS), None
    for it in range(n_iterations):
        rng, key = jax.random.split(rng)
        host_params = jax.device_get(trainer.params)  # act on one device, train on all
        transitions, obs = rollout(envs, obs, policy, host_params, key, returns, running)
        first_returns = first_returns or list(returns)
        for epoch in range(N_EPOCHS_PER_ITERATION):  # epoch: the shuffle's seed
            trainer.train(transitions, PER_DEVICE_BATCH_SIZE,
                          epoch=it * N_EPOCHS_PER_ITERATION + epoch, check_layout=args.check_layout)
        recent = np.mean(returns[-20:]) if returns else float("nan")
        print(f"iteration {it + 1}/{n_iterations}: {len(returns)} episodes, mean return of the "
              f"last 20 {recent:.1f}")

    host_params = jax.device_get(trainer.params)
    greedy = lambda o: jax.device_get(policy(host_params, o, rng, greedy=True)[0])
    final_return = evaluate(envs, greedy, seed=1000)
    first_return = float(np.mean(first_returns)) if first_returns else 0.0
    print(f"trained policy (greedy): mean return {final_return:.1f}; first iteration's episodes "
          f"{first_return:.1f}; random policy {random_return:.1f}")
    metrics = {"return_trained": final_return, "return_first_iteration": first_return,
               "return_random": random_return, "env_steps": n_iterations * N_ENVS * N_STEPS,
               "updates": trainer.step}
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)


if __name__ == "__main__":
    main()
