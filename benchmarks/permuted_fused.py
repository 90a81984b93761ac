"""Fused 2-D projections stored permuted: per-layer traffic and parameter memory, as written vs
stored permuted (redcoast/sharding/permuted.py), on 8 simulated CPU devices (dp 2 x mp 4).

Models: the test suite's GPT-2 written with a 2-D fused ``c_attn`` (hidden, 3*hidden), and, when
a transformers release that still ships Flax is importable (4.57.6: ``pip install --no-deps
--target DIR transformers==4.57.6 tokenizers==0.22.1 huggingface_hub==0.36.0`` and
``PYTHONPATH=DIR``), Hugging Face's own ``FlaxGPT2LMHeadModel`` (c_attn kernel (3*hidden,
hidden) applied transposed). For each: the tensor-parallel plan traced from the loss, one SGD
step compiled at two depths and differenced (redcoast/layout/comms.py). Columns: per-layer 'mp' wire
bytes over Megatron-LM's; device 0's parameter bytes over a 1/4 share, per layer (differenced)
and for the whole model; the same over Megatron's own placement (its norms, row biases and
position table replicated). 'Trainer': the same model through a Trainer with every default
(AdamW, FSDP and fusion left to the layout choice), its own compiled step and ``trainer.params``.

    python benchmarks/permuted_fused.py
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from redcoast.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from redcoast.layout.comms import megatron_ideal, per_layer  # noqa: E402
from redcoast.sharding.dataflow import dataflow_placements  # noqa: E402
from redcoast.sharding.grouped_axes import named_sharding  # noqa: E402
from redcoast.sharding.paths import path_to_tuple  # noqa: E402
from redcoast.sharding.permuted import permuted_placements, storage_loss, to_storage  # noqa: E402

N, DP = 4, 2


def tests_gpt2(depth):
    from architectures import B, H, T, gpt2
    arch = gpt2(n_layers=depth)
    return arch.params, arch.loss, arch.batch, (B, T, H)


def hf_gpt2(depth):
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModel
    B, T, H, V = 8, 8, 64, 128
    config = GPT2Config(vocab_size=V, n_positions=16, n_embd=H, n_layer=depth, n_head=8,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = FlaxGPT2LMHeadModel(config, seed=0)
    ids = np.random.default_rng(0).integers(0, V, (B, T + 1)).astype(np.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": np.ones((B, T), np.int32),
             "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))}

    def loss(params, batch):
        logits = model.module.apply({"params": params}, batch["inputs"], batch["mask"], batch["positions"],
                                    deterministic=True)[0]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return jax.tree_util.tree_map(np.asarray, model.params), loss, batch, (B, T, H)


def megatron_share(params):
    """Device bytes under Megatron's plan: every 2-D+ matmul weight and the biases of column
    layers split; layer norms, row-layer biases and the position table replicated."""
    total = 0
    for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = "/".join(path_to_tuple(kp))
        split = any(s in name for s in ("c_attn", "c_fc", "c_proj/weight", "c_proj/kernel", "wte"))
        total += x.nbytes // (N if split else 1)
    return total


def measure(make, permute):
    mesh = jax.make_mesh((DP, N), ("dp", "mp"), axis_types=(AxisType.Auto,) * 2)
    held = {}

    def compiled(depth):
        params, loss, batch, _ = make(depth)
        if permute:
            placements, perms = permuted_placements(loss, params, batch, n_model_shards=N)
        else:
            placements, perms = dataflow_placements(loss, params, batch, n_model_shards=N), {}
        by_path = {pl.path: pl.spec for pl in placements}
        shardings = jax.tree_util.tree_map_with_path(
            lambda kp, _: named_sharding(mesh, by_path[path_to_tuple(kp)]), params)
        stored = jax.jit(lambda p: to_storage(p, perms), out_shardings=shardings)(params)
        leaves = jax.tree_util.tree_leaves(stored)
        held[depth] = (sum(x.addressable_shards[0].data.nbytes for x in leaves), sum(x.nbytes for x in leaves),
                       megatron_share(params), len(perms))
        run = storage_loss(loss, perms)

        def step(p, b):
            return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, p, jax.grad(run)(p, b))
        return jax.jit(step, in_shardings=(shardings, NamedSharding(mesh, P("dp"))),
                       out_shardings=shardings).lower(stored, batch).compile()

    layer = per_layer(compiled, mesh, depths=(1, 2))
    B, T, H = make(1)[3]
    ideal = megatron_ideal(B // DP, T, H, N)["wire_bytes"]
    (d1, t1, _, _), (d2, t2, m2, k2) = held[1], held[2]
    return (layer.get("mp", {}).get("wire_bytes", 0) / ideal, (d2 - d1) / ((t2 - t1) / N), d2 / (t2 / N),
            d2 / m2, k2)


def measure_trainer(make):
    """The same through a Trainer with every default (AdamW; FSDP and fusion left to its choice)."""
    from redcoast import Deployer, Trainer
    trainers = {}

    def compiled(depth):
        params, loss, batch, _ = make(depth)
        trainers[depth] = Trainer(Deployer(jax_seed=0, n_model_shards=N, verbose=False), _collate, None,
                                  lambda rng, state, p, b, is_training: loss(p, b), params, optax.adamw(1e-3))
        return trainers[depth].compile_train_step(batch)

    layer = per_layer(compiled, Deployer(n_model_shards=N, verbose=False).mesh, depths=(1, 2))
    B, T, H = make(1)[3]
    ideal = megatron_ideal(B // DP, T, H, N)["wire_bytes"]
    held = {d: [x for x in jax.tree_util.tree_leaves(t.params)] for d, t in trainers.items()}
    d1, d2 = (sum(x.addressable_shards[0].data.nbytes for x in held[d]) for d in (1, 2))
    t1, t2 = (sum(x.nbytes for x in held[d]) for d in (1, 2))
    return (layer.get("mp", {}).get("wire_bytes", 0) / ideal, (d2 - d1) / ((t2 - t1) / N), d2 / (t2 / N),
            d2 / megatron_share(make(2)[0]), len(trainers[2].layout.plan.permutations))


def _collate(rows):  # compile_train_step is given batches, never examples
    raise AssertionError("not called")


def main():
    models = {"tests' gpt2 (Conv1D, c_attn (H, 3H))": tests_gpt2}
    try:
        import transformers.models.gpt2.modeling_flax_gpt2  # noqa: F401
        models["HF FlaxGPT2LMHeadModel (c_attn (3H, H))"] = hf_gpt2
    except ImportError as e:
        print(f"(Hugging Face's Flax GPT-2 not importable here: {e}; see the docstring)")
    print(f"{'model':<42}{'layout':<10}{'mp/Megatron':>12}{'dev0/share layer':>18}{'dev0/share all':>16}"
          f"{'dev0/Megatron':>15}{'permuted':>10}")
    t0 = time.perf_counter()
    for name, make in models.items():
        for label, run in (("written", lambda: measure(make, False)), ("permuted", lambda: measure(make, True)),
                           ("Trainer", lambda: measure_trainer(make))):
            ratio, layer_mem, all_mem, mega, k = run()
            print(f"{name:<42}{label:<10}{ratio:>11.3f}x{layer_mem:>17.3f}x"
                  f"{all_mem:>15.3f}x{mega:>14.3f}x{k:>10}", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s; jax {jax.__version__}, {jax.device_count()} CPU devices, "
          f"dp {DP} x mp {N}; 'permuted': leaves stored permuted at depth 2)")


if __name__ == "__main__":
    main()
