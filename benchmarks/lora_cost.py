"""LoRA against full fine-tuning: FLOPs of the compiled training step and optimizer-state bytes.

For a real-size config (default SmolLM2-135M's: Llama, 30 layers, hidden 576, vocab 49152,
tied embeddings), two training steps written as redcoast's Trainer runs them (value_and_grad of
a causal-LM loss, adamw update) are lowered on abstract inputs (nothing of the model is
allocated) and compiled on one CPU device:

- full: every parameter trained;
- lora: the base a frozen input of the step, adapters of rank r on the chosen kernels merged
  inside the step (redcoast.lora: ``W + alpha/r * A @ B``), only the adapters trained;
- freeze: full fine-tuning's step with ``optax.multi_transform`` training only the chosen
  kernels (themselves, not adapters) and ``optax.set_to_zero()`` for the rest (README,
  "Fine-tuning part of a model");
- floor: the same with only the first layer's norm scale trained: the backward pass through
  every layer with no weight gradient, the least any adapter on every layer can cost.

Printed: XLA's ``cost_analysis()`` FLOPs of each compiled step, the compiled step's temporary
memory (``memory_analysis()``), the optimizer state's bytes, and the ratios LoRA / full.

    python benchmarks/lora_cost.py [--batch 4] [--seq 256] [--rank 8] [--layers N]
        [--targets REGEX] [--bf16]
"""

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from redcoast.lora import DEFAULT_TARGETS, LoRA, count  # noqa: E402
from redcoast.models import Model, llama  # noqa: E402
from redcoast.layout.steps import cast_floating  # noqa: E402

SMOLLM2_135M = llama.Config(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                            rope_theta=100000.0, tie_word_embeddings=True,
                            max_position_embeddings=8192)


def nbytes(tree):
    return sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


def lm_loss(model, params, ids):
    logits = model.apply(params, ids[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def compiled(step, *abstract_args):
    c = jax.jit(step, donate_argnums=(0, 1)).lower(*abstract_args).compile()
    return c.cost_analysis()["flops"], c.memory_analysis().temp_size_in_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a quicker check)")
    ap.add_argument("--targets", default=DEFAULT_TARGETS)
    ap.add_argument("--bf16", action="store_true", help="compute in bfloat16 (fp32 master weights)")
    args = ap.parse_args()

    config = SMOLLM2_135M
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers)
    model = Model(llama.MODULES["LlamaForCausalLM"], config)
    dtype = jnp.bfloat16 if args.bf16 else jnp.float32
    base = model.abstract_params()
    lora = LoRA(rank=args.rank, alpha=2.0 * args.rank, targets=args.targets)
    adapters = jax.eval_shape(lora.init, base)
    optimizer = optax.adamw(1e-4)
    ids = jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)

    def full_step(params, opt_state, ids):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(model, cast_floating(p, dtype), ids))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def lora_step(adapters, opt_state, base, ids):
        frozen = cast_floating(base, dtype)
        loss, grads = jax.value_and_grad(
            lambda a: lm_loss(model, lora.merge(frozen, cast_floating(a, dtype)), ids))(adapters)
        updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, loss

    def freezing(trained):
        """Full fine-tuning's step with only the kernels at ``trained`` paths updated."""
        labels = jax.tree_util.tree_map_with_path(
            lambda kp, _: "train" if tuple(str(k.key) for k in kp) in trained else "freeze", base)
        tx = optax.multi_transform({"train": optimizer, "freeze": optax.set_to_zero()}, labels)

        def step(params, opt_state, ids):
            loss, grads = jax.value_and_grad(lambda p: lm_loss(model, cast_floating(p, dtype), ids))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        state = jax.eval_shape(tx.init, base)
        return (sum(int(np.prod(_at(base, p).shape)) for p in trained), nbytes(state),
                *compiled(step, base, state, ids))

    # 'floor': only the first layer's norm scale trained: every activation gradient, no weight
    # gradient (what any adapter placed from the first layer on must at least compute)
    floor = freezing({("layers", "0", "input_layernorm", "scale")})
    freeze = freezing({tuple(p) for p in lora.selected(base)})
    full_state = jax.eval_shape(optimizer.init, base)
    lora_state = jax.eval_shape(optimizer.init, adapters)
    full = (count(base), nbytes(full_state), *compiled(full_step, base, full_state, ids))
    lora_row = (count(adapters), nbytes(lora_state),
                *compiled(lora_step, adapters, lora_state, base, ids))

    print(f"config: SmolLM2-135M shape, {config.num_hidden_layers} layers, {count(base) / 1e6:.1f}M "
          f"parameters; batch {args.batch} x {args.seq} tokens; compute {jnp.dtype(dtype).name}; "
          f"adamw; LoRA rank {args.rank} on {len(lora.selected(base))} kernels ({args.targets}); "
          "freeze: those kernels trained whole (optax.multi_transform + set_to_zero); floor: "
          "only layer 0's norm trained")
    columns = [("full", full), ("lora", lora_row), ("freeze", freeze), ("floor", floor)]
    print(f"{'':26s}" + "".join(f"{n:>11s}" for n, _ in columns)
          + "".join(f"{n + '/full':>12s}" for n, _ in columns[1:]))
    names = ["trained parameters", "optimizer state (bytes)", "step FLOPs (compiled)",
             "step temp memory (bytes)"]
    for i, name in enumerate(names):
        print(f"{name:26s}" + "".join(f"{c[i]:11.4g}" for _, c in columns)
              + "".join(f"{c[i] / full[i]:12.4f}" for _, c in columns[1:]))


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


if __name__ == "__main__":
    main()
