"""Deep deterministic policy gradient (DDPG, Lillicrap et al., 2016) on Pendulum-v1, with redcoast.

    python examples/ddpg/main.py            # full run
    python examples/ddpg/main.py --tiny     # CI-sized run

An off-policy agent with continuous actions: a deterministic actor mu(s) in [-2, 2] and a critic
Q(s, a), trained from a replay buffer. Every 50 environment steps the agent samples 50 minibatches
from the buffer, computes their TD targets r + gamma * Q'(s', mu'(s')) with the target networks
(a ``Predictor`` given the target parameters), and runs those 50 updates with ``trainer.train``
(one loss: the critic's TD error plus the actor's -Q(s, mu(s)) with the critic held fixed). The
target networks then move towards the trained ones (Polyak averaging, at the rate of tau=0.005
per update). Exploration adds Gaussian noise to the actor's action; the first 1000 steps act at
random to fill the buffer.

The metric is the mean return of the trained actor (no noise) on 5 fixed episodes, beside a
uniformly random policy's and the untrained actor's on the same episodes (Pendulum's returns
are negative; 0 is the best). Tiny mode shows a clear improvement, not a solved task.

The MLPs are small, so one copy per device (n_model_shards=1); minibatches are split over the
8 (simulated) devices as data parallelism.
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

GAMMA, TAU, NOISE = 0.99, 0.005, 0.2
PER_DEVICE_BATCH_SIZE = 16   # 128 transitions per update on 8 devices
UPDATE_EVERY = 50            # environment steps (and updates) between training calls
WARMUP_STEPS = 1000


class Actor(nn.Module):
    bound: float

    @nn.compact
    def __call__(self, obs):
        x = nn.relu(nn.Dense(64)(nn.relu(nn.Dense(64)(obs))))
        return self.bound * nn.tanh(nn.Dense(1)(x))


class Critic(nn.Module):
    @nn.compact
    def __call__(self, obs, action):
        x = jnp.concatenate([obs, action], -1)
        return nn.Dense(1)(nn.relu(nn.Dense(64)(nn.relu(nn.Dense(64)(x)))))[..., 0]


actor, critic = Actor(bound=2.0), Critic()


# A transition is one row of floats: obs (3), action, reward, next obs (3), terminated, and its
# TD target once computed; examples are 2-D arrays of such rows (any sequence of rows will do).
COLUMNS = {"obs": slice(0, 3), "action": slice(3, 4), "reward": 4, "next_obs": slice(5, 8),
           "terminated": 8, "td_target": 9}


def collate_fn(rows):
    rows = np.stack(rows)
    return {key: rows[:, cols] for key, cols in COLUMNS.items()}


def loss_fn(rng, state, params, batch, is_training):
    """The critic's TD error plus the actor's -Q(s, mu(s)) (the critic fixed for the actor)."""
    q = critic.apply({"params": params["critic"]}, batch["obs"], batch["action"])
    critic_loss = jnp.mean((q - batch["td_target"]) ** 2)
    fixed_critic = jax.lax.stop_gradient(params["critic"])
    actor_loss = -jnp.mean(critic.apply({"params": fixed_critic}, batch["obs"],
                                        actor.apply({"params": params["actor"]}, batch["obs"])))
    return critic_loss + actor_loss, {"critic_loss": critic_loss, "q": jnp.mean(q)}


def target_q_fn(rng, params, batch):
    """Q'(s', mu'(s')) with the target networks (``params`` are the target parameters)."""
    next_action = actor.apply({"params": params["actor"]}, batch["next_obs"])
    return critic.apply({"params": params["critic"]}, batch["next_obs"], next_action)


class ReplayBuffer:
    """The last ``size`` transitions, as rows of one array."""

    def __init__(self, size):
        self.rows, self.count = np.zeros((size, 10), np.float32), 0

    def add(self, obs, action, reward, next_obs, terminated):
        self.rows[self.count % len(self.rows), :9] = np.concatenate(
            [obs, action, [reward], next_obs, [terminated]])
        self.count += 1

    def sample(self, n, rng):
        return self.rows[rng.integers(min(self.count, len(self.rows)), size=n)]  # a copy


def evaluate(env, act, n_episodes=5):
    """Mean return over ``n_episodes`` fixed episodes (seeds 1000, 1001, ...)."""
    returns = []
    for episode in range(n_episodes):
        obs, done, total = env.reset(seed=1000 + episode)[0], False, 0.0
        while not done:
            obs, reward, terminated, truncated, _ = env.step(act(obs))
            total, done = total + reward, terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a short run for CI")
    parser.add_argument("--metrics-out", help="write the final metrics here as JSON")
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch (Trainer.check_layout)")
    parser.add_argument("--workdir", default=os.path.join("workdir", "ddpg"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n_steps = 5000 if args.tiny else 20000  # Pendulum's episodes are 200 steps

    env = gym.make("Pendulum-v1")
    env.action_space.seed(args.seed)
    deployer = Deployer(jax_seed=args.seed, n_model_shards=1, workdir=args.workdir, verbose=False)
    obs_dim = env.observation_space.shape[0]
    params = {"actor": jax.jit(actor.init)(deployer.gen_rng(), jnp.zeros((1, obs_dim)))["params"],
              "critic": jax.jit(critic.init)(deployer.gen_rng(), jnp.zeros((1, obs_dim)),
                                             jnp.zeros((1, 1)))["params"]}
    labels = lambda p: {name: jax.tree_util.tree_map(lambda _: name, p[name]) for name in p}
    optimizer = optax.multi_transform({"actor": optax.adam(1e-3), "critic": optax.adam(1e-3)},
                                      labels)
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=None, loss_fn=loss_fn,
                      params=params, optimizer=optimizer)
    target_predictor = trainer.get_default_predictor(pred_fn=target_q_fn)
    target = jax.device_get(params)
    act = jax.jit(lambda p, obs: actor.apply({"params": p}, obs))

    rng = np.random.default_rng(args.seed)
    random_return = evaluate(env, lambda obs: env.action_space.sample())
    untrained_return = evaluate(env, lambda obs: np.asarray(act(target["actor"], obs)))
    print(f"random policy: mean return {random_return:.1f}; untrained actor {untrained_return:.1f}")

    buffer = ReplayBuffer(100_000)
    batch_size = deployer.global_batch_size(PER_DEVICE_BATCH_SIZE)
    tau = 1 - (1 - TAU) ** UPDATE_EVERY  # UPDATE_EVERY Polyak steps of TAU, applied at once
    obs, episode_return, returns = env.reset(seed=args.seed)[0], 0.0, []
    actor_params = target["actor"]
    for step in range(1, n_steps + 1):
        if step <= WARMUP_STEPS:
            action = env.action_space.sample()
        else:
            action = np.clip(np.asarray(act(actor_params, obs)) + NOISE * rng.normal(size=1), -2, 2)
        next_obs, reward, terminated, truncated, _ = env.step(action)
        buffer.add(obs=obs, action=action, reward=reward, next_obs=next_obs, terminated=terminated)
        obs, episode_return = next_obs, episode_return + reward
        if terminated or truncated:
            returns.append(episode_return)
            print(f"step {step}: episode {len(returns)} return {episode_return:.1f}")
            obs, episode_return = env.reset()[0], 0.0
        if step > WARMUP_STEPS and step % UPDATE_EVERY == 0:
            transitions = buffer.sample(UPDATE_EVERY * batch_size, rng)
            next_q = np.array(target_predictor.predict(  # all 50 minibatches in one batch
                transitions, UPDATE_EVERY * PER_DEVICE_BATCH_SIZE, target))
            transitions[:, 9] = transitions[:, 4] + GAMMA * (1 - transitions[:, 8]) * next_q
            trainer.train(transitions, PER_DEVICE_BATCH_SIZE, epoch=step, shuffle=False,
                          check_layout=args.check_layout)
            trained = jax.device_get(trainer.params)
            target = jax.tree_util.tree_map(lambda t, p: (1 - tau) * t + tau * p, target, trained)
            actor_params = trained["actor"]

    trained_return = evaluate(env, lambda obs: np.asarray(act(actor_params, obs)))
    print(f"trained actor: mean return {trained_return:.1f}; untrained {untrained_return:.1f}; "
          f"random {random_return:.1f}")
    metrics = {"return_trained": trained_return, "return_untrained": untrained_return,
               "return_random": random_return, "env_steps": n_steps, "updates": trainer.step}
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)


if __name__ == "__main__":
    main()
