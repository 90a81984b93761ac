"""Per-step overhead of redcoast's Trainer against a hand-written JAX loop.

Both loops train the same small decoder LM (Flax Linen) on the same examples, with the same
collate_fn, batch size, number of steps, mesh (dp x mp on 8 simulated CPU devices) and the very
same parameter / optimizer-state shardings (taken from the Trainer's plan):

  (a) redcoast: ``trainer.train(examples, per_device_batch_size, log_every_n_steps=N)``: its real
      loop (collate per batch, placement in a background prefetch thread, the jitted step,
      progress bar, metrics pulled to the host every N steps);
  (b) by hand: per step ``collate_fn`` -> ``jax.make_array_from_process_local_data`` onto
      ``NamedSharding(mesh, P('dp'))`` -> ``jax.jit(step, in_shardings, out_shardings,
      donate_argnums=0)`` (value_and_grad + optax update); the loss is pulled to the host every
      N steps too, as a hand-written loop that prints its loss would;
  (c) diagnostic (skip with ``--no-breakdown``): loop (b) driving the Trainer's own compiled step,
      so that (a)/(c) is the cost of the Trainer's Python loop and (c)/(b) the cost of what its
      step does beyond value_and_grad + update (rng, step counter, non-finite-loss guard).

Both loops collate and place every batch (neither reuses a placed batch), run the same number of
steps on the same examples in the same order, and sync with the host equally often. Compilation
is excluded (each loop is warmed up first); each measurement is one epoch of ``--steps`` steps
timed end to end (until the last update is ready); the loops alternate A, B, A, B, ...
``--repeats`` times and medians are reported. Run from the repository root:

    python benchmarks/overhead.py                 # about 1-3 minutes on a 2-core CPU
    python benchmarks/overhead.py --steps 100 --repeats 9 --d-model 256 --no-breakdown
"""

import os

import sys  # noqa: E402

# Benchmark this checkout's redcoast, whatever copy happens to be installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from redcoast.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)  # before JAX's first computation; existing XLA flags are kept

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import flax  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from redcoast import Deployer, Trainer  # noqa: E402
from redcoast.data import epoch_order  # noqa: E402


# ----------------------------------------------------------------------------------------------
# The model: a small pre-norm decoder-only transformer LM.

class Block(nn.Module):
    d_model: int
    n_heads: int

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        hd = d // self.n_heads
        h = nn.LayerNorm(name="ln_attn")(x)
        q = nn.Dense(d, use_bias=False, name="query")(h).reshape(b, t, self.n_heads, hd)
        k = nn.Dense(d, use_bias=False, name="key")(h).reshape(b, t, self.n_heads, hd)
        v = nn.Dense(d, use_bias=False, name="value")(h).reshape(b, t, self.n_heads, hd)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d)
        x = x + nn.Dense(d, use_bias=False, name="out")(att)
        h = nn.LayerNorm(name="ln_mlp")(x)
        h = nn.gelu(nn.Dense(4 * d, name="up")(h))
        return x + nn.Dense(d, name="down")(h)


class DecoderLM(nn.Module):
    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    max_len: int

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab_size, self.d_model, name="embed")(ids)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                         (self.max_len, self.d_model))
        x = x + pos[: ids.shape[1]]
        for i in range(self.n_layers):
            x = Block(self.d_model, self.n_heads, name=f"block_{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return nn.Dense(self.vocab_size, use_bias=False, name="lm_head")(x)


def lm_loss(logits, ids):
    """Mean next-token cross-entropy."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), ids[:, 1:]).mean()


def collate_fn(examples):
    """List of {'ids': int array of seq_len} -> {'input_ids': (batch, seq_len) int32}."""
    return {"input_ids": np.stack([ex["ids"] for ex in examples]).astype(np.int32)}


# ----------------------------------------------------------------------------------------------
# The two loops.

def make_hand_loop(model, optimizer, trainer, global_batch):
    """The hand-written loop, placed exactly like the Trainer's state."""
    mesh = trainer.mesh
    batch_sharding = NamedSharding(mesh, P("dp"))
    param_shardings = trainer.plan.param_shardings()
    opt_shardings = jax.tree_util.tree_map(lambda x: x.sharding, trainer.state.opt_state)
    state_shardings = (param_shardings, opt_shardings)
    replicated = NamedSharding(mesh, P())

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(
            lambda p: lm_loss(model.apply({"params": p}, batch["input_ids"]), batch["input_ids"])
        )(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    jitted = jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                     out_shardings=(state_shardings, replicated), donate_argnums=0)

    def init(params):
        params = jax.device_put(params, param_shardings)
        opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
        return params, opt_state

    def place(local):
        return jax.tree_util.tree_map(
            lambda x: jax.make_array_from_process_local_data(batch_sharding, x, x.shape), local)

    def run_epoch(state, examples, order, n_steps, log_every, step_fn=None):
        """One epoch: collate, place, step; the loss to the host every ``log_every`` steps.
        ``step_fn(state, batch) -> (state, loss)`` defaults to the hand-written step."""
        step_fn = step_fn or jitted
        pending = []
        for i in range(n_steps):
            idx = order[i * global_batch:(i + 1) * global_batch]
            batch = place(collate_fn([examples[int(j)] for j in idx]))
            state, loss = step_fn(state, batch)
            pending.append(loss)
            if (log_every and len(pending) == log_every) or i + 1 == n_steps:
                losses = jax.device_get(pending)  # what a loop that prints its loss does
                if not np.all(np.isfinite(np.asarray(losses, dtype=np.float64))):
                    raise FloatingPointError("non-finite loss in the hand-written loop")
                pending = []
        jax.block_until_ready(state)
        return state

    return init, run_epoch, jitted


def cache_size(jitted):
    """Number of compiled versions of a jitted function (None if JAX does not say)."""
    try:
        return jitted._cache_size()
    except Exception:  # private API; only used as a recompilation check
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=25, help="steps per timed epoch")
    ap.add_argument("--repeats", type=int, default=20,
                    help="timed epochs of each loop (alternating)")
    ap.add_argument("--warmup-steps", type=int, default=5, help="untimed steps of each loop first")
    ap.add_argument("--per-device-batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--n-model-shards", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=10,
                    help="both loops pull their loss to the host every N steps and at the end "
                         "of each epoch (0: only at the end)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                    help="skip the third measurement (the hand-written loop driving the Trainer's "
                         "own compiled step), which splits the gap into loop and in-step costs")
    args = ap.parse_args()

    deployer = Deployer(jax_seed=args.seed, n_model_shards=args.n_model_shards, verbose=False)
    global_batch = deployer.global_batch_size(args.per_device_batch_size)

    model = DecoderLM(args.vocab_size, args.d_model, args.n_heads, args.n_layers, args.seq_len)
    optimizer = optax.adamw(1e-3)
    init_params = lambda: model.init(jax.random.PRNGKey(args.seed),
                                     jnp.zeros((1, args.seq_len), jnp.int32))["params"]
    params = init_params()
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))

    def loss_fn(rng, state, params, batch, is_training):
        return lm_loss(state.apply_fn({"params": params}, batch["input_ids"]), batch["input_ids"])

    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=model.apply,
                      loss_fn=loss_fn, params=params, optimizer=optimizer)
    rng = np.random.default_rng(args.seed)
    n_examples = args.steps * global_batch
    examples = [{"ids": rng.integers(0, args.vocab_size, args.seq_len, dtype=np.int32)}
                for _ in range(n_examples)]
    warm = examples[:args.warmup_steps * global_batch]

    # The Trainer settles its placement (traced from loss_fn) at its first batch: train once
    # before copying its shardings into the hand-written loop.
    trainer.train(warm, args.per_device_batch_size, log_every_n_steps=args.log_every)
    hand_init, hand_epoch, hand_step = make_hand_loop(model, optimizer, trainer, global_batch)
    hand_state = hand_init(init_params())

    order_of = lambda epoch, n: epoch_order(n, deployer.jax_seed, epoch)  # the Trainer's order

    def run_trainer(examples, epoch):
        trainer.train(examples, args.per_device_batch_size, epoch=epoch,
                      log_every_n_steps=args.log_every)
        jax.block_until_ready(trainer.state)  # train() syncs on its last log already; be sure

    def run_hand(examples, epoch):
        nonlocal hand_state
        hand_state = hand_epoch(hand_state, examples, order_of(epoch, len(examples)),
                                len(examples) // global_batch, args.log_every)

    def run_hand_with_trainer_step(examples, epoch):
        # Diagnostic: the hand-written loop driving the Trainer's own compiled step (private
        # attributes), which splits the gap into host-side loop cost and in-step extras.
        def step(state, batch):
            state, metrics = trainer.layout.train_step(state, batch, trainer.progress.train_key)
            return state, metrics["loss"]
        trainer._state = hand_epoch(trainer._state, examples, order_of(epoch, len(examples)),
                                    len(examples) // global_batch, args.log_every, step_fn=step)

    loops = {"redcoast Trainer": run_trainer, "hand-written jax.jit": run_hand}
    if args.breakdown and hasattr(trainer, "_state"):
        loops["hand loop, Trainer step"] = run_hand_with_trainer_step

    # Warm-up: compile every step, start the thread machinery, touch every code path once.
    t0 = time.perf_counter()
    for run in loops.values():
        run(warm, 0)
    warmup_s = time.perf_counter() - t0
    trainer_step = trainer.layout.train_step
    sizes_before = cache_size(trainer_step), cache_size(hand_step)

    # Timed: one epoch of each loop in turn (A, B, A, B, ...), so slow phases of a shared
    # machine hit both alike; per-step time = epoch wall time / steps.
    times = {name: [] for name in loops}
    for r in range(args.repeats):
        for name, run in loops.items():
            t = time.perf_counter()
            run(examples, r + 1)
            times[name].append((time.perf_counter() - t) / args.steps)
        print(f"  repeat {r + 1}/{args.repeats}: " + ", ".join(
            f"{name} {1e3 * ts[-1]:.2f}" for name, ts in times.items()) + " ms/step", flush=True)
    sizes_after = cache_size(trainer_step), cache_size(hand_step)

    a, b = times["redcoast Trainer"], times["hand-written jax.jit"]
    med_a, med_b = statistics.median(a), statistics.median(b)
    pair_ratio = statistics.median([x / y for x, y in zip(a, b)])

    print()
    print("configuration")
    print(f"  jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}, "
          f"python {platform.python_version()}, {os.cpu_count()} host cores")
    print(f"  devices: {jax.device_count()} x {jax.devices()[0].platform}; "
          f"mesh dp={deployer.n_data_shards} x mp={deployer.n_model_shards}")
    print(f"  model: decoder LM, {args.n_layers} layers, d_model {args.d_model}, "
          f"{args.n_heads} heads, vocab {args.vocab_size}, seq {args.seq_len}: "
          f"{n_params / 1e6:.2f} M params (fp32), adamw")
    print(f"  batch: {args.per_device_batch_size} per device x {deployer.n_data_shards} dp = "
          f"{global_batch} sequences ({global_batch * args.seq_len} tokens) per step")
    print(f"  timing: {args.repeats} alternating repeats x {args.steps} steps each; loss to host "
          f"every {args.log_every} steps in both; warm-up/compile {warmup_s:.1f} s excluded")
    if None in sizes_before + sizes_after:
        print("  (recompilation check unavailable on this JAX)")
    elif sizes_before != sizes_after:
        print(f"  WARNING: recompilation during timing: compiled versions trainer/hand "
              f"{sizes_before} -> {sizes_after}")
    else:
        print(f"  no recompilation during timing (compiled versions trainer/hand: {sizes_after})")
    print()
    print(f"  {'loop':<26}{'median ms/step':>16}{'min':>10}{'max':>10}")
    for name, ts in times.items():
        print(f"  {name:<26}{1e3 * statistics.median(ts):>16.2f}{1e3 * min(ts):>10.2f}"
              f"{1e3 * max(ts):>10.2f}")
    verdict = "OK" if med_a / med_b <= 1.05 else "ABOVE TARGET"
    print(f"  {'ratio trainer / hand':<26}{med_a / med_b:>16.3f}   (median of paired ratios "
          f"{pair_ratio:.3f}; target <= 1.05: {verdict})")
    if "hand loop, Trainer step" in times:
        c = times["hand loop, Trainer step"]
        med_c = statistics.median(c)
        paired = lambda xs, ys: statistics.median([x / y for x, y in zip(xs, ys)])
        print(f"    of which Trainer's Python loop    (a)/(c) {med_a / med_c:6.3f}   "
              f"(paired {paired(a, c):.3f})")
        print(f"    of which Trainer's compiled step  (c)/(b) {med_c / med_b:6.3f}   "
              f"(paired {paired(c, b):.3f})")


if __name__ == "__main__":
    main()
