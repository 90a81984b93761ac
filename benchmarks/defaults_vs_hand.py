"""The Trainer with every default against one hand-written ``jax.jit`` step (issue 13, task B1).

Model: redcoast's Llama (hidden 256, 4 layers, 8 heads / 4 KV heads, intermediate 512,
vocabulary 1024, so the embedding and LM head are 1 MiB each: at the FSDP threshold, every other
tensor below it), sequence 128, AdamW, global batch 16, on 8 simulated CPU devices as dp x mp =
8x1, 4x2, 2x4 and 1x8.

  redcoast: ``Trainer(deployer, collate, model.apply, loss, params, optimizer)`` with every
            default; its training step, compiled for the first batch as ``train`` would;
  by hand:  ``jax.jit(value_and_grad + optax update, in_shardings, out_shardings,
            donate_argnums=0)`` with Megatron-LM's tensor-parallel placement written as the paper's
            rules (Q/K/V/gate/up split by columns, O/down by rows, embedding and LM head by
            vocabulary), state replicated over 'dp'.

Both step the same pre-placed batches; compilation is excluded (one warm-up call each). The two
alternate, A B B A A B ..., ``--repeats`` times, each timing ``--steps`` steps end to end; medians are
printed. 'state/dev' is parameter + optimizer-state bytes on device 0. Run from the repository root:

    python benchmarks/defaults_vs_hand.py                       # a few minutes on 2 cores
    python benchmarks/defaults_vs_hand.py --meshes 4x2 --repeats 7 --collectives
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from redcoast.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from redcoast import Deployer, Trainer  # noqa: E402
from redcoast.layout.comms import collective_report  # noqa: E402
from redcoast.models import Model, llama  # noqa: E402

SEQ, GLOBAL_BATCH, VOCAB = 128, 16, 1024

# Megatron-LM's placement as a user would write it (the paper's rule format)
HAND_RULES = [
    (("embed_tokens", "embedding"), P("mp", None)),
    (("(q_proj|k_proj|v_proj|gate_proj|up_proj)", "kernel"), P(None, "mp")),
    (("(o_proj|down_proj)", "kernel"), P("mp", None)),
    (("lm_head", "kernel"), P(None, "mp")),
    ((".*",), P()),
]


def make_model(layers=4):
    return Model(llama.LlamaForCausalLM, llama.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ))


def lm_loss(model):
    def loss(rng, state, params, batch, is_training):
        logits = model.apply(params, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()
    return loss


def collate(rows):
    return {"ids": np.stack([r["ids"] for r in rows]).astype(np.int32)}


def state_bytes_on_device0(tree):
    """Bytes of ``tree``'s arrays held by the first device."""
    dev = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree_util.tree_leaves(tree)
               for s in x.addressable_shards if s.device == dev)


def setup(n_model_shards, examples, optimizer):
    """(redcoast step closure, hand step closure, state bytes, compiled steps) on one mesh."""
    model = make_model()
    deployer = Deployer(n_model_shards=n_model_shards, verbose=False)
    mesh = deployer.mesh
    batch_sharding = NamedSharding(mesh, P("dp"))
    batch = collate(examples[:GLOBAL_BATCH])

    trainer = Trainer(deployer, collate, model.apply, lm_loss(model), model.init(0), optimizer)
    compiled_rc = trainer.compile_train_step(batch)  # fixes the plan as the first batch would
    placed = jax.device_put(batch, NamedSharding(trainer.mesh, P("dp")))
    rc = {"state": trainer._state}
    rng = trainer.progress.train_key

    def rc_step():
        rc["state"], metrics = trainer.layout.train_step(rc["state"], placed, rng)
        return metrics["loss"]

    plan = deployer.get_sharding_plan(model.abstract_params(), HAND_RULES)
    param_sh = plan.param_shardings()
    params = jax.jit(lambda p: p, out_shardings=param_sh)(model.init(0))
    opt_sh = plan.opt_state_shardings(jax.eval_shape(optimizer.init, params))
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
    loss_fn = lm_loss(model)
    replicated = NamedSharding(mesh, P())

    def step(state, b):
        p, o = state
        loss, grads = jax.value_and_grad(lambda q: loss_fn(None, None, q, b, True))(p)
        updates, o = optimizer.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), loss

    hand_jit = jax.jit(step, in_shardings=((param_sh, opt_sh), batch_sharding),
                       out_shardings=((param_sh, opt_sh), replicated), donate_argnums=0)
    hand = {"state": (params, opt_state)}
    hand_placed = jax.device_put(batch, batch_sharding)
    compiled_hand = hand_jit.lower(hand["state"], hand_placed).compile()

    def hand_step():
        hand["state"], loss = hand_jit(hand["state"], hand_placed)
        return loss

    sizes = (state_bytes_on_device0((rc["state"].params, rc["state"].opt_state)),
             state_bytes_on_device0(hand["state"]))
    return trainer, rc_step, hand_step, sizes, (compiled_rc, compiled_hand)


def timed(step, n):
    t0 = time.perf_counter()
    for _ in range(n):
        loss = step()
    jax.block_until_ready(loss)
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--meshes", default="8x1,4x2,2x4,1x8")
    ap.add_argument("--steps", type=int, default=8, help="steps per timed run")
    ap.add_argument("--repeats", type=int, default=5, help="alternating runs per program")
    ap.add_argument("--collectives", action="store_true", help="print both steps' collectives")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    examples = [{"ids": rng.integers(0, VOCAB, SEQ + 1).astype(np.int32)}
                for _ in range(GLOBAL_BATCH)]
    optimizer = optax.adamw(1e-3)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices; "
          f"{args.repeats} alternating runs of {args.steps} steps; medians")
    print(f"{'mesh':>5} {'redcoast ms':>11} {'hand ms':>8} {'step ratio':>10} "
          f"{'state/dev MiB':>14} {'hand MiB':>9} {'state ratio':>11}  layout")
    for mesh_text in args.meshes.split(","):
        dp, mp = (int(x) for x in mesh_text.split("x"))
        assert dp * mp == jax.device_count(), mesh_text
        trainer, rc_step, hand_step, (rc_bytes, hand_bytes), compiled = setup(mp, examples, optimizer)
        rc_step(), hand_step()  # warm up (compile, first placement)
        rc_times, hand_times = [], []
        for r in range(args.repeats):  # A B, then B A: neither always runs first
            if r % 2:
                hand_times.append(timed(hand_step, args.steps))
            rc_times.append(timed(rc_step, args.steps))
            if not r % 2:
                hand_times.append(timed(hand_step, args.steps))
        rc_ms, hand_ms = statistics.median(rc_times) * 1e3, statistics.median(hand_times) * 1e3
        ratios = [a / b for a, b in zip(rc_times, hand_times)]
        layout = getattr(trainer, "layout", None)
        print(f"{mesh_text:>5} {rc_ms:11.1f} {hand_ms:8.1f} {statistics.median(ratios):10.3f} "
              f"{rc_bytes / 2**20:14.2f} {hand_bytes / 2**20:9.2f} {rc_bytes / hand_bytes:11.3f}  "
              f"{getattr(layout, 'name', '') if layout is not None else ''}", flush=True)
        if args.collectives:
            mesh = trainer.mesh
            for name, c in zip(("redcoast", "hand"), compiled):
                print(f"      {name:>8}: {collective_report(c, mesh).summary()}")


if __name__ == "__main__":
    main()
