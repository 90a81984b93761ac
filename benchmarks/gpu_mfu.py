"""Model FLOPs utilisation of a ~1B-parameter Llama trained through redcoast's Trainer.

    python benchmarks/gpu_mfu.py                      # on one GPU: 1.1B Llama, bf16, sequence 2048
    python benchmarks/gpu_mfu.py --tiny               # anywhere (CPU): checks the script runs

The model has TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 KV heads, SwiGLU 5632,
vocabulary 32000), random weights and random tokens: speed does not depend on the values. The
Trainer runs its real loop (collate, prefetch, sharded step, donated state) with fp32 master
parameters and bf16 compute.

FLOPs per token, stated as in PaLM (Chowdhury et al. 2022, appendix B):
    6 * N  +  12 * n_layers * seq * hidden
N counts the parameters of every matmul (attention, MLP and the LM head; not the input embedding,
which is a lookup); the second term is the attention score and value matmuls (QK^T and AV),
forward and backward, without discounting the causal mask. MFU = FLOPs per token * tokens/s /
the device's peak dense bf16 FLOP/s (989 TFLOP/s for an H100 or H200 SXM; give --peak-tflops
for another device).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model and sequence: a smoke run")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--per-device-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="timed training steps")
    p.add_argument("--remat", action="store_true", help="recompute each layer in the backward")
    p.add_argument("--fp32", action="store_true", help="fp32 compute instead of bf16")
    p.add_argument("--peak-tflops", type=float, default=None)
    return p.parse_args()


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
    from redcoast.models.llama import LlamaConfig, LlamaForCausalLM

    compute = jnp.float32 if args.fp32 else jnp.bfloat16
    if args.tiny:
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, dtype=compute, remat=args.remat)
        seq, batch, steps = 64, 2, 3
    else:
        config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                             num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                             max_position_embeddings=args.seq, dtype=compute, remat=args.remat)
        seq, batch, steps = args.seq, args.per_device_batch, args.steps

    model = Model(LlamaForCausalLM, config)
    deployer = Deployer(n_model_shards=1, verbose=False)
    params = model.init(0)

    def collate(rows):
        return {"ids": np.stack([r["ids"] for r in rows])}

    def loss_fn(rng, state, params, batch, is_training):
        logits = state.apply_fn(params, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()

    trainer = Trainer(deployer, collate, model.apply, loss_fn, params, optax.adamw(1e-4),
                      compute_dtype=compute)
    global_batch = deployer.global_batch_size(batch)
    rng = np.random.default_rng(0)
    examples = [{"ids": rng.integers(0, config.vocab_size, seq + 1).astype(np.int32)}
                for _ in range(global_batch * (steps + 2))]

    t0 = time.perf_counter()
    trainer.train(examples[:2 * global_batch], batch, shuffle=False)  # compile + first steps
    jax.block_until_ready(trainer.params)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.train(examples[2 * global_batch:], batch, shuffle=False)
    jax.block_until_ready(trainer.params)
    elapsed = time.perf_counter() - t0

    n_total = sum(x.size for x in jax.tree_util.tree_leaves(params))
    embed = config.vocab_size * config.hidden_size  # the input lookup: no matmul FLOPs
    n_matmul = n_total - embed + (embed if config.tie_word_embeddings else 0)
    n_matmul -= sum(x.size for x in jax.tree_util.tree_leaves(params) if x.ndim == 1)  # norms
    flops_per_token = 6 * n_matmul + 12 * config.num_hidden_layers * seq * config.hidden_size
    tokens_per_s = steps * global_batch * seq / elapsed
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in kind), None)
    print(f"device: {kind} x {jax.device_count()}; jax {jax.__version__}")
    print(f"model: {n_total / 1e9:.3f} B parameters ({n_matmul / 1e9:.3f} B in matmuls), "
          f"sequence {seq}, global batch {global_batch}, compute {jnp.dtype(compute).name}, "
          f"remat {config.remat}")
    print(f"first call (compile + 2 steps): {compile_s:.1f} s; {steps} timed steps: "
          f"{elapsed / steps * 1e3:.1f} ms/step")
    print(f"tokens/s: {tokens_per_s:,.0f}   (per device: {tokens_per_s / jax.device_count():,.0f})")
    achieved = flops_per_token * tokens_per_s / jax.device_count()
    print(f"model FLOP/s per device: {achieved / 1e12:.1f} TFLOP/s "
          f"({flops_per_token / 1e9:.2f} GFLOP per token)")
    if peak:
        print(f"MFU: {achieved / (peak * 1e12):.1%} of {peak:.0f} TFLOP/s peak bf16")
    else:
        print("MFU: unknown peak for this device (give --peak-tflops)")


if __name__ == "__main__":
    main()
