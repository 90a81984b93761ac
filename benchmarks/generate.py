"""Generation against the memory limit and a hand-written loop: greedy and beam search, one
device and sharded.

    python benchmarks/generate.py            # 8 simulated CPU devices (or the real ones: --real)
    python benchmarks/generate.py --real --model-shards 1   # one GPU
    python benchmarks/generate.py --tiny     # a 2-layer toy, every row once (CI's slow step)

A random-weight Llama (SmolLM2-135M's shape by default: hidden 576, 30 layers, 9 heads, 3 KV
heads, fp32; --small for a 4-layer one) generates a fixed number of new tokens (no EOS) after
left-padded prompts of 8-32 tokens. Every figure is measured in this run:

1. **The machine's memory bandwidth**: the reference is a read of a 1 GiB array (XLA's sum, every
   core; decoding reads and hardly writes), the best of a few; beside it one core's read
   (numpy's sum) and two copies (bytes read + written: numpy's on one thread, XLA's in place on
   every core). On a 2-core host the read varies between runs by half (33-48 GB/s measured),
   with how the array's pages happen to be mapped.
2. **Decode at batch 1**: seconds per new token on the one CPU device the machine has (a fresh
   process without simulated devices: splitting the cores among 8 costs a tenth here), taken as
   the difference between a long and a short generation divided by the tokens between them (so
   the prompt's prefill and the call's fixed costs drop out), and the bytes each token must read
   (every parameter once, the tied head included, and the KV cache) per second, as a share of
   the bandwidth. redcoast's ``generate`` and the hand-written loop of
   ``benchmarks/hand_decode.py``, beside the floor under both: the same weights streamed by
   nothing but a token's chain of matrix-vector products (``hand_decode.weights_alone``; on
   XLA:CPU each product runs on one core, so no decode loop here goes faster).
3. **Batch ``--batch``, greedy and beam search**: seconds per call, redcoast and the hand loop
   (greedy; beam search with ``--beams``), on one device, then in a Predictor's ``pred_fn`` on
   the whole mesh (batch over 'dp', parameters over 'mp' as the plan splits them, model shards 1
   and 2) against the hand loop jitted with the same shardings. The programs alternate, each the
   median of ``--repeats`` timed calls after a compiling one; both must give the same tokens.
"""

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--real", action="store_true", help="use the machine's devices as they are")
    p.add_argument("--small", action="store_true", help="4 layers instead of 30")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer, 64-wide toy, 6 new tokens, one timed call per row")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=32, help="new tokens per row")
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model-shards", default="1,2",
                   help="the Predictor rows' model shards, comma-separated (one GPU: 1)")
    p.add_argument("--decode-only", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def bandwidths(np, jax, jnp, gib=1.0, tries=5):
    """Bytes per second over a ``gib`` GiB float32 array: {how: rate}. Decoding reads its weights
    and writes next to nothing, so the reference is a read (XLA's sum, on every core), beside
    one core's read (numpy's sum); the copies count the bytes read and written."""
    n = int(gib * 2 ** 30) // 4
    src = np.arange(n, dtype=np.float32)
    dst = np.empty_like(src)
    by_numpy = min(_seconds(lambda: np.copyto(dst, src)) for _ in range(tries))
    # into the buffer it reads (donated): a fresh output each call would time the operating
    # system's first touch of its pages too
    add_one = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = [add_one(jnp.asarray(src))]

    def in_place():
        x[0] = jax.block_until_ready(add_one(x[0]))
    by_xla = min(_seconds(in_place) for _ in range(tries))
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x[0]))
    read = min(_seconds(lambda: jax.block_until_ready(total(x[0]))) for _ in range(tries))
    one_core = min(_seconds(lambda: src.sum()) for _ in range(tries))
    return {"read (XLA sum)": 4 * n / read, "read, one core (numpy sum)": 4 * n / one_core,
            "copy (numpy, one thread)": 8 * n / by_numpy, "copy in place (XLA)": 8 * n / by_xla}


def _seconds(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def build(args):
    """The model, its parameters and the left-padded prompts, the same in every process."""
    import numpy as np

    from redcoast.models import Model
    from redcoast.models.generate import left_pad
    from redcoast.models.llama import LlamaConfig, LlamaForCausalLM

    if args.tiny:
        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True, initializer_range=0.5)
    else:
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_hidden_layers=4 if args.small else 30, num_attention_heads=9,
                             num_key_value_heads=3, tie_word_embeddings=True, rope_theta=1e5)
    model = Model(LlamaForCausalLM, config)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, config.vocab_size, int(n)))
               for n in rng.integers(8, 33, args.batch)]
    ids, mask = left_pad(prompts, pad_id=0)
    return config, model, model.init(0), ids, mask


def timed(programs, repeats):
    """({name: median seconds}, {name: output}) of zero-argument programs, each called once
    to compile, then alternating."""
    import numpy as np

    outputs = {name: np.asarray(fn()) for name, fn in programs.items()}
    times = {name: [] for name in programs}
    for _ in range(repeats):
        for name, fn in programs.items():
            times[name].append(_seconds(lambda: np.asarray(fn())))
    return {name: float(np.median(t)) for name, t in times.items()}, outputs


def decode_rows(args):
    """Sections 1 and 2, on the devices this process has; False where the tokens differ."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import hand_decode
    from redcoast.models.generate import generate

    config, model, params, ids, mask = build(args)
    print(f"{jax.device_count()} {jax.devices()[0].platform} device(s); model: "
          f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, fp32")
    rates = bandwidths(np, jax, jnp, gib=1 / 16 if args.tiny else 1)
    bandwidth = rates["read (XLA sum)"]
    size = "64 MiB" if args.tiny else "1 GiB"
    print(f"\nmemory bandwidth over {size}: "
          + ", ".join(f"{how} {rate / 1e9:.1f} GB/s" for how, rate in rates.items())
          + f"; the reference: the read, {bandwidth / 1e9:.1f} GB/s")
    one_core = rates["read, one core (numpy sum)"]

    one_ids, one_mask = ids[:1], mask[:1]
    short, long = 8, 8 + 4 * args.new
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    cache_bytes = (2 * config.num_hidden_layers * (one_ids.shape[1] + long) *
                   config.num_key_value_heads * config.head_dim * 4)
    per_token_bytes = param_bytes + cache_bytes // 2  # the cache read is half full on average
    programs = {}
    for n in (short, long):
        programs[f"redcoast {n}"] = (lambda n=n: generate(model, params, one_ids, one_mask,
                                                          max_new_tokens=n, eos_token_id=()))
        programs[f"hand {n}"] = (lambda n=n: hand_decode.greedy(config, params, one_ids, one_mask,
                                                                n))
        programs[f"weights alone {n}"] = (lambda n=n: hand_decode.weights_alone(config, params,
                                                                                 n))
    seconds, outputs = timed(programs, args.repeats)
    print(f"\ndecode at batch 1, one device ({per_token_bytes / 1e6:.0f} MB read per token; "
          f"new tokens {short} and {long}, the difference timed)")
    per_token = {who: (seconds[f"{who} {long}"] - seconds[f"{who} {short}"]) / (long - short)
                 for who in ("redcoast", "hand", "weights alone")}
    floor = per_token["weights alone"]
    print(f"{'program':<14} {'ms/token':>9} {'tokens/s':>9} {'GB/s':>6} {'of the read':>12} "
          f"{'of one core':>12} {'of weights alone':>17}")
    for who, seconds_each in per_token.items():  # the floor reads the weights, not the cache
        rate = (param_bytes if who == "weights alone" else per_token_bytes) / seconds_each
        print(f"{who:<14} {seconds_each * 1e3:9.2f} {1 / seconds_each:9.1f} {rate / 1e9:6.1f} "
              f"{rate / bandwidth:12.0%} {rate / one_core:12.0%} {floor / seconds_each:17.0%}")
    same = all((outputs[f"redcoast {n}"] == outputs[f"hand {n}"]).all() for n in (short, long))
    print(f"same tokens: {'yes' if same else 'NO'}", flush=True)
    return bool(same)


def batch_rows(args):
    """Section 3, on every device; False where the tokens differ."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import hand_decode
    from redcoast import Deployer, Predictor
    from redcoast.models.generate import generate

    config, model, params, ids, mask = build(args)
    settings = {"greedy": dict(), f"beam{args.beams}": dict(num_beams=args.beams)}
    all_same = True

    def hand(params, ids, mask, kw):
        if kw.get("num_beams", 1) > 1:
            return hand_decode.beam(config, params, ids, mask, args.new, kw["num_beams"])
        return hand_decode.greedy(config, params, ids, mask, args.new)

    def row(name, where, programs):
        nonlocal all_same
        seconds, outputs = timed(programs, args.repeats)
        same = (outputs["redcoast"] == outputs["hand"]).all()
        all_same &= bool(same)
        print(f"{name:<8} {where:<30} {seconds['redcoast']:10.3f} {seconds['hand']:8.3f} "
              f"{seconds['redcoast'] / seconds['hand']:6.2f} {'yes' if same else 'NO':>11}",
              flush=True)

    print(f"\n{jax.device_count()} {jax.devices()[0].platform} devices; batch {args.batch}, "
          f"{args.new} new tokens (seconds per call; ratio redcoast / hand)")
    print(f"{'setting':<8} {'where':<30} {'redcoast s':>10} {'hand s':>8} {'ratio':>6} "
          f"{'same tokens':>11}")
    for name, kw in settings.items():
        row(name, "direct, one device", {
            "redcoast": lambda kw=kw: generate(model, params, ids, mask, max_new_tokens=args.new,
                                               eos_token_id=(), **kw),
            "hand": lambda kw=kw: hand(params, jnp.asarray(ids), jnp.asarray(mask), kw)})

    examples = [{"ids": ids[i], "mask": mask[i]} for i in range(args.batch)]
    collate = lambda rows: {k: np.stack([r[k] for r in rows]) for k in rows[0]}  # noqa: E731
    for n in (int(x) for x in args.model_shards.split(",")):
        deployer = Deployer(n_model_shards=n, verbose=False)
        per_device = max(1, args.batch // deployer.n_data_shards)
        plan = deployer.get_sharding_plan(model.abstract_params(), traced_fn=model.apply,
                                          example_args=(jax.ShapeDtypeStruct((1, 8), np.int32),))
        sharded = jax.device_put(params, plan.param_shardings())
        rows = NamedSharding(deployer.mesh, P("dp"))
        for name, kw in settings.items():
            def pred_fn(rng, p, batch, kw=kw):
                return generate(model, p, batch["ids"], batch["mask"], max_new_tokens=args.new,
                                eos_token_id=(), **kw)

            predictor = Predictor(deployer, collate, pred_fn)
            row(name, f"Predictor, dp={deployer.n_data_shards} x mp={n}", {
                "redcoast": lambda: np.stack(predictor.predict(examples, per_device, sharded)),
                "hand": lambda kw=kw: hand(sharded, jax.device_put(ids, rows),
                                           jax.device_put(mask, rows), kw)})
    return all_same


def main():
    args = parse()
    if args.tiny:
        args.batch, args.new, args.beams, args.repeats = 8, 6, 2, 1
    if args.decode_only:  # the fresh process of sections 1 and 2: the machine's own device
        sys.exit(0 if decode_rows(args) else 1)
    if args.real:
        same = decode_rows(args)
    else:
        argv = [sys.executable, os.path.abspath(__file__), "--decode-only"] + sys.argv[1:]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        same = subprocess.run(argv, env=env).returncode == 0  # non-zero: differing or failed
        from redcoast.simulate import simulate_cpu_devices

        simulate_cpu_devices(8)
    same &= batch_rows(args)
    if not same:
        sys.exit("redcoast's tokens differ from the hand-written loop's, or a section failed "
                 "(see above)")


if __name__ == "__main__":
    main()
