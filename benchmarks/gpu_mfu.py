"""Model FLOPs utilisation of a ~1B-parameter Llama trained through redcoast's Trainer, beside a
hand-written ``jax.jit`` step of the same model.

    python benchmarks/gpu_mfu.py                      # on one GPU: 1.1B Llama, bf16, sequence 2048
    python benchmarks/gpu_mfu.py --tiny               # anywhere (CPU): checks the script runs

The model has TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 KV heads, SwiGLU 5632,
vocabulary 32000), random weights and random tokens: speed does not depend on the values. The
Trainer runs its real loop (collate, prefetch, sharded step, donated state) with fp32 master
parameters and bf16 compute, every other setting at its default. The reference is one jitted,
donated AdamW step written by hand around the same model and loss.

Before anything runs, the script chooses the per-device batch and rematerialisation that fit
the device: for each candidate (largest batch without rematerialisation first) it compiles the
hand-written step on abstract inputs and reads XLA's memory analysis against the device's limit.

FLOPs per token, stated as in PaLM (Chowdhery et al. 2022, appendix B):
    6 * N  +  12 * n_layers * seq * hidden
N counts the parameters of every matmul (attention, MLP and the LM head; not the input embedding,
which is a lookup); the second term is the attention score and value matmuls (QK^T and AV),
forward and backward, without discounting the causal mask. Rematerialised work is not counted
(model FLOPs). MFU = FLOPs per token * tokens/s / the device's peak (redcoast.layout.throughput's
table, or --peak-tflops). XLA's own count of the compiled step (what the Trainer logs as
train_mfu; it includes recomputation) is printed beside it.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model and sequence: a smoke run")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--per-device-batch", type=int, default=8,
                   help="the largest batch to try; smaller ones are tried if it does not fit")
    p.add_argument("--remat", choices=("auto", "on", "off"), default="auto",
                   help="recompute each layer in the backward pass (auto: only if needed to fit)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of each program")
    p.add_argument("--fp32", action="store_true", help="fp32 compute instead of bf16")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--memory-fraction", type=float, default=0.9,
                   help="share of the device's memory limit a candidate may plan to use")
    return p.parse_args()


def candidates(max_batch, seq, remat):
    """(per-device batch, remat) in order of preference: the largest batch without recomputation
    while it keeps >= 8192 tokens per device, then recomputation from the largest batch down."""
    batches = [max_batch // 2 ** i for i in range(max_batch.bit_length()) if max_batch // 2 ** i]
    plain = [(b, False) for b in batches if b * seq >= 8192 or b == max_batch]
    recomputed = [(b, True) for b in batches]
    if remat == "off":
        return [(b, False) for b in batches]
    if remat == "on":
        return recomputed
    return plain + recomputed


def versions():
    import jax
    import jaxlib

    device = jax.devices()[0]
    platform = getattr(device.client, "platform_version", "") or ""
    return (f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, {jax.device_count()} x "
            f"{getattr(device, 'device_kind', device.platform)} ({platform.strip() or 'n/a'})")


def main():
    args = parse()
    if args.tiny:
        from redcoast.simulate import simulate_cpu_devices

        simulate_cpu_devices(1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from redcoast import Deployer, Trainer
    from redcoast.models import Model
    from redcoast.models.attention import choose_implementation, cuda_capability
    from redcoast.models.llama import LlamaConfig, LlamaForCausalLM
    from redcoast.layout.steps import cast_floating
    from redcoast.layout.throughput import compiled_flops, peak_flops

    compute = jnp.float32 if args.fp32 else jnp.bfloat16
    if args.tiny:
        shape = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
        seq, max_batch, steps = 64, 2, 3
    else:
        shape = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4)
        seq, max_batch, steps = args.seq, args.per_device_batch, args.steps
    optimizer = optax.adamw(1e-4)
    deployer = Deployer(n_model_shards=1, verbose=False)
    budget = deployer.device_memory_budget() * args.memory_fraction

    def build(remat):
        config = LlamaConfig(**shape, max_position_embeddings=seq, dtype=compute, remat=remat)
        return config, Model(LlamaForCausalLM, config)

    def loss_of(apply, params, ids):
        logits = apply(params, ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    def hand_step_for(model):
        def step(state, ids):
            params, opt_state = state
            loss, grads = jax.value_and_grad(
                lambda p: loss_of(model.apply, cast_floating(p, compute), ids))(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss
        return jax.jit(step, donate_argnums=0)

    # 1. choose what fits, from the compiled step's memory analysis (nothing allocated)
    print(versions())
    chosen = None
    for batch, remat in candidates(max_batch, seq, args.remat):
        config, model = build(remat)
        params = model.abstract_params()
        state = (params, jax.eval_shape(optimizer.init, params))
        ids = jax.ShapeDtypeStruct((batch * jax.device_count(), seq + 1), jnp.int32)
        m = hand_step_for(model).lower(state, ids).compile().memory_analysis()
        need = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes \
            + m.temp_size_in_bytes
        fits = need <= budget
        print(f"candidate: per-device batch {batch}, remat {remat}: {need / 2**30:.1f} GiB "
              f"of {budget / 2**30:.1f} GiB -> {'fits' if fits else 'too large'}")
        if fits:
            chosen = batch, remat
            break
    if chosen is None:
        raise SystemExit("no candidate fits this device: give a smaller --seq or --per-device-batch")
    batch, remat = chosen
    config, model = build(remat)
    params = model.init(0)
    global_batch = deployer.global_batch_size(batch)
    rng = np.random.default_rng(0)
    data = rng.integers(0, config.vocab_size, (global_batch * (steps + 1), seq + 1)).astype(np.int32)
    examples = [{"ids": row} for row in data]

    # 2. the Trainer with defaults
    def collate(rows):
        return {"ids": np.stack([r["ids"] for r in rows])}

    def loss_fn(rng, state, params, batch, is_training):
        return loss_of(state.apply_fn, params, batch["ids"])

    trainer = Trainer(deployer, collate, model.apply, loss_fn, params, optimizer,
                      compute_dtype=compute)

    def run_trainer():
        t0 = time.perf_counter()
        trainer.train(examples[global_batch:], batch, shuffle=False, log_every_n_steps=steps)
        jax.block_until_ready(trainer.params)
        return (time.perf_counter() - t0) / steps

    # 3. the hand-written step: its own copy of the state, batches already on the device
    hand = hand_step_for(model)
    hand_state = jax.jit(lambda p: (jax.tree_util.tree_map(jnp.copy, p), optimizer.init(p)))(params)
    device_batches = [jnp.asarray(data[i * global_batch:(i + 1) * global_batch])
                      for i in range(1, steps + 1)]

    def run_hand():
        nonlocal hand_state
        t0 = time.perf_counter()
        for ids in device_batches:
            hand_state, loss = hand(hand_state, ids)
        jax.block_until_ready((hand_state, loss))
        return (time.perf_counter() - t0) / steps

    # 4. the Trainer's own compiled step called in a plain loop on batches already placed:
    # its program alone, so that a gap to the hand step splits into program and loop
    from jax.sharding import NamedSharding, PartitionSpec as P

    def run_step_alone():
        t0 = time.perf_counter()
        for ids in step_batches:
            trainer._state, metrics = trainer.layout.train_step(
                trainer._state, {"ids": ids}, trainer._progress.train_key)
        jax.block_until_ready((trainer._state, metrics))
        return (time.perf_counter() - t0) / steps

    t0 = time.perf_counter()
    trainer.train(examples[:global_batch], batch, shuffle=False)  # layout, compile, one step
    jax.block_until_ready(trainer.params)
    t1 = time.perf_counter()
    hand_state, _ = hand(hand_state, device_batches[0])
    jax.block_until_ready(hand_state)
    t2 = time.perf_counter()
    print(f"first update (compile + one step): Trainer {t1 - t0:.1f} s, hand-written "
          f"{t2 - t1:.1f} s ({(t1 - t0) / (t2 - t1):.2f}x; both after the memory check above "
          "compiled a hand step once, so XLA's in-process caches, GPU autotuning's among them, "
          "were warm for both)")
    rows = NamedSharding(trainer.mesh, P("dp"))
    step_batches = [jax.device_put(np.asarray(ids), rows) for ids in device_batches]
    redcoast_s, hand_s, alone_s = [], [], []
    for _ in range(args.rounds):  # alternate: the machine's noise falls on all alike
        redcoast_s.append(run_trainer())
        hand_s.append(run_hand())
        alone_s.append(run_step_alone())
    step_s, ref_s = float(np.median(redcoast_s)), float(np.median(hand_s))
    alone = float(np.median(alone_s))

    # 5. FLOPs and MFU
    leaves = jax.tree_util.tree_leaves(params)
    n_total = sum(x.size for x in leaves)
    embed = config.vocab_size * config.hidden_size  # the input lookup: no matmul FLOPs
    n_matmul = n_total - embed + (embed if config.tie_word_embeddings else 0)
    n_matmul -= sum(x.size for x in leaves if x.ndim == 1)  # norms
    flops_per_token = 6 * n_matmul + 12 * config.num_hidden_layers * seq * config.hidden_size
    tokens = global_batch * seq
    device = jax.devices()[0]
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device, compute)
    xla_flops = compiled_flops(hand.lower(hand_state, device_batches[0]).compile())
    head_dim = config.hidden_size // config.num_attention_heads
    attention = choose_implementation(
        (batch, seq, config.num_attention_heads, head_dim),
        (batch, seq, config.num_key_value_heads, head_dim), compute, has_mask=False,
        capability=cuda_capability(device), requested=config.attention_implementation)
    print(f"model: {n_total / 1e6:,.1f} M parameters ({n_matmul / 1e6:,.1f} M in matmuls), "
          f"sequence {seq}, per-device batch {batch}, global batch {global_batch}, compute "
          f"{jnp.dtype(compute).name}, remat {remat}, attention {attention.implementation} "
          f"({attention.reason})")
    print(f"FLOPs per token (6N + 12*L*s*h): {flops_per_token / 1e6:,.2f} MFLOP; XLA counts "
          f"{'n/a' if xla_flops is None else f'{xla_flops / tokens / 1e6:,.2f} MFLOP'} per token "
          "in the compiled step")
    for name, seconds in (("redcoast Trainer", step_s), ("hand-written jit", ref_s),
                          ("its step alone", alone)):
        rate = tokens / seconds
        achieved = flops_per_token * rate / jax.device_count()
        mfu = f"{achieved / peak:.1%}" if peak else "n/a (unknown peak: give --peak-tflops)"
        print(f"{name:17s}: {seconds * 1e3:8.1f} ms/step, {rate:12,.0f} tokens/s, "
              f"{achieved / 1e12:7.1f} TFLOP/s per device, MFU {mfu}")
    print(f"redcoast / hand-written step time: {step_s / ref_s:.3f} (medians of {args.rounds} "
          f"alternating rounds of {steps} steps); the Trainer's compiled step alone, in a plain "
          f"loop: {alone / ref_s:.3f}; each round's Trainer / hand: "
          + " ".join(f"{a / b:.3f}" for a, b in zip(redcoast_s, hand_s)))
    stats = getattr(device, "memory_stats", lambda: None)() or {}
    if stats.get("peak_bytes_in_use"):
        print(f"peak device memory: {stats['peak_bytes_in_use'] / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
