"""Cost of keeping the last finite state after a NaN loss (the guard in steps.make_train_step).

Two jitted, donated training steps of the same MLP with AdamW, alternating A, B, A, B, ...:
  (a) unguarded: params, opt_state = adamw update (what redcoast did before: NaN params in memory);
  (b) guarded: the same, each new leaf selected with ``jnp.where(ok, new, old)``, ``ok`` the
      loss's finiteness;
  (c) cond: the update inside ``lax.cond(ok, update, keep)``;
  (d) zero: gradients and updates zeroed where not ``ok`` (what redcoast does now: the
      parameters of a non-finite step stay exactly as they were).
Prints the median step time of each, XLA's temporary memory of each compiled step, and the time
ratios, measured in this one run.

    python benchmarks/nonfinite_guard.py --width 4096 --layers 8 --steps 20 --repeats 7
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax


def make_step(tx, guarded):
    def loss_fn(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return jnp.mean(x ** 2)

    def update(grads, opt_state, params):
        updates, new_opt = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt

    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        if guarded == "cond":
            new_params, new_opt = jax.lax.cond(jnp.isfinite(loss), update,
                                               lambda g, o, p: (p, o), grads, opt_state, params)
            return new_params, new_opt, loss
        if guarded == "zero":
            ok = jnp.isfinite(loss)
            grads = jax.tree_util.tree_map(lambda g: jnp.where(ok, g, 0), grads)
            updates, new_opt = tx.update(grads, opt_state, params)
            updates = jax.tree_util.tree_map(lambda u: jnp.where(ok, u, 0), updates)
            return optax.apply_updates(params, updates), new_opt, loss
        new_params, new_opt = update(grads, opt_state, params)
        if guarded:
            ok = jnp.isfinite(loss)
            keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
            new_params = jax.tree_util.tree_map(keep, new_params, params)
            new_opt = jax.tree_util.tree_map(keep, new_opt, opt_state)
        return new_params, new_opt, loss

    return jax.jit(step, donate_argnums=(0, 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tx = optax.adamw(1e-3)
    keys = jax.random.split(jax.random.PRNGKey(0), args.layers + 1)
    x = jax.random.normal(keys[-1], (args.batch, args.width))
    steps = {"unguarded": make_step(tx, False), "guarded": make_step(tx, True),
             "cond": make_step(tx, "cond"), "zero": make_step(tx, "zero")}
    states = {}
    for name, step in steps.items():
        params = [jax.random.normal(k, (args.width, args.width)) / args.width ** 0.5
                  for k in keys[:-1]]
        opt_state = tx.init(params)
        params, opt_state, loss = step(params, opt_state, x)  # compile
        jax.block_until_ready(loss)
        states[name] = (params, opt_state)
    memory = {}
    for name, step in steps.items():  # XLA's own accounting of the compiled step
        m = step.lower(*states[name], x).compile().memory_analysis()
        memory[name] = (m.temp_size_in_bytes, m.output_size_in_bytes - m.alias_size_in_bytes)
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            params, opt_state = states[name]
            start = time.perf_counter()
            for _ in range(args.steps):
                params, opt_state, loss = step(params, opt_state, x)
            jax.block_until_ready((params, opt_state, loss))
            times[name].append((time.perf_counter() - start) / args.steps)
            states[name] = (params, opt_state)
    med = {name: statistics.median(t) for name, t in times.items()}
    n_params = args.layers * args.width ** 2
    print(f"device: {jax.devices()[0].device_kind}; {n_params / 1e6:.1f} M parameters, AdamW, "
          f"{args.steps} steps x {args.repeats} repeats, alternating")
    for name, t in med.items():
        temp, unaliased = memory[name]
        print(f"  {name:10s} median step {t * 1e3:.3f} ms; temp {temp / 2**20:.1f} MiB, "
              f"outputs not aliased to the donated inputs {unaliased / 2**20:.1f} MiB")
    print(f"  guarded / unguarded = {med['guarded'] / med['unguarded']:.3f}")
    print(f"  cond / unguarded = {med['cond'] / med['unguarded']:.3f}")
    print(f"  zero / unguarded = {med['zero'] / med['unguarded']:.3f}")


if __name__ == "__main__":
    main()
