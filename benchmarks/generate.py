"""Tokens per second of redcoast's generation: greedy and beam search, one device and sharded.

    python benchmarks/generate.py            # 8 simulated CPU devices (or the real ones: --real)

A random-weight Llama (SmolLM2-135M's shape by default: hidden 576, 30 layers, 9 heads, 3 KV
heads; --small for a 4-layer one) generates ``--new`` tokens for a batch of left-padded prompts
of different lengths. Rows:
- direct: ``generate(model, params, ...)`` on one device (compiled once, then timed);
- predictor: the same inside a Predictor's ``pred_fn`` on the whole mesh: the batch split over
  'dp', the parameters over 'mp' (n_model_shards 1, 2).
Each figure is the median of ``--repeats`` timed calls after one compiling call; generation stops
only at ``max_new_tokens`` (no EOS), so every row costs the same number of decode steps.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--real", action="store_true", help="use the machine's devices as they are")
    p.add_argument("--small", action="store_true", help="4 layers instead of 30")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=32, help="new tokens per row")
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args()


def main():
    args = parse()
    if not args.real:
        from redcoast.simulate import simulate_cpu_devices

        simulate_cpu_devices(8)
    import jax
    import numpy as np

    from redcoast import Deployer, Predictor
    from redcoast.models import Model
    from redcoast.models.generate import generate, left_pad
    from redcoast.models.llama import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=4 if args.small else 30, num_attention_heads=9,
                         num_key_value_heads=3, tie_word_embeddings=True, rope_theta=1e5)
    model = Model(LlamaForCausalLM, config)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, config.vocab_size, int(n))) for n in rng.integers(8, 33, args.batch)]
    ids, mask = left_pad(prompts, pad_id=0)
    settings = {"greedy": dict(), f"beam{args.beams}": dict(num_beams=args.beams)}

    def timed(fn):
        jax.block_until_ready(fn())  # compile
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def tokens_per_s(seconds):
        return args.batch * args.new / seconds

    print(f"{jax.device_count()} {jax.devices()[0].platform} devices; model: {config.num_hidden_layers} "
          f"layers, hidden {config.hidden_size}; batch {args.batch}, prompts 8-32 tokens, "
          f"{args.new} new tokens")
    print(f"{'setting':<10} {'where':<34} {'s/call':>8} {'new tokens/s':>13}")
    params = model.init(0)
    for name, kw in settings.items():
        s = timed(lambda: generate(model, params, ids, mask, max_new_tokens=args.new, **kw))
        print(f"{name:<10} {'direct, one device':<34} {s:8.3f} {tokens_per_s(s):13.1f}")

    examples = [{"ids": ids[i], "mask": mask[i]} for i in range(args.batch)]
    collate = lambda rows: {k: np.stack([r[k] for r in rows]) for k in rows[0]}  # noqa: E731
    for n in (1, 2):
        deployer = Deployer(n_model_shards=n, verbose=False)
        per_device = max(1, args.batch // deployer.n_data_shards)
        for name, kw in settings.items():
            def pred_fn(rng, p, batch, kw=kw):
                return generate(model, p, batch["ids"], batch["mask"], max_new_tokens=args.new, **kw)

            predictor = Predictor(deployer, collate, pred_fn)
            plan = deployer.get_sharding_plan(model.abstract_params(), traced_fn=model.apply,
                                              example_args=(jax.ShapeDtypeStruct((1, 8), np.int32),))
            sharded = jax.device_put(params, plan.param_shardings())
            s = timed(lambda: predictor.predict(examples, per_device, sharded))
            where = f"Predictor, dp={deployer.n_data_shards} x mp={n}"
            print(f"{name:<10} {where:<34} {s:8.3f} {tokens_per_s(s):13.1f}")


if __name__ == "__main__":
    main()
