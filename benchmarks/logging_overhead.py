"""What the throughput and gradient-norm logging costs a training step.

The Trainer logs step time, examples/s, tokens/s and MFU from shapes, wall time and the compiled
step's cost analysis (read once per compiled step), pulled with the metrics at each logging
interval: no transfer of its own. The gradient norm is the one addition to the compiled step
(a reduction over the gradients, returned with the loss). This script trains the same small
Llama through two Trainers that differ only in ``log_grad_norm``, alternating epochs, and
prints the ratio of their step times and the one-off cost of reading the step's FLOPs.

    python benchmarks/logging_overhead.py             # 8 simulated CPU devices, dp 4 x mp 2
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from redcoast.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from redcoast import Deployer, Trainer  # noqa: E402
from redcoast.data import EpochData  # noqa: E402
from redcoast.loop.step_meter import StepMeter  # noqa: E402
from redcoast.models import Model  # noqa: E402
from redcoast.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args()

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = Model(LlamaForCausalLM, config)
    seq, per_device = 64, 2

    def collate(rows):
        return {"ids": np.stack([r["ids"] for r in rows])}

    def loss_fn(rng, state, params, batch, is_training):
        logits = state.apply_fn(params, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()

    trainers = {}
    for grad_norm in (False, True):
        deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)
        trainers[grad_norm] = Trainer(deployer, collate, model.apply, loss_fn, model.init(0),
                                      optax.adamw(1e-4), log_grad_norm=grad_norm)
    global_batch = trainers[True].deployer.global_batch_size(per_device)
    rng = np.random.default_rng(0)
    examples = [{"ids": rng.integers(0, config.vocab_size, seq + 1).astype(np.int32)}
                for _ in range(global_batch * args.steps)]

    def epoch(trainer):
        t0 = time.perf_counter()
        trainer.train(examples, per_device, shuffle=False, log_every_n_steps=args.log_every)
        jax.block_until_ready(trainer.params)
        return (time.perf_counter() - t0) / args.steps

    for trainer in trainers.values():  # compile, and read the step's cost (once)
        trainer.train(examples[:global_batch * 2], per_device, shuffle=False, log_every_n_steps=1)
    trainer = trainers[True]
    batch = trainer._first_batch(EpochData(examples, 0, 0, shuffle=False), per_device, trainer.mesh)
    meter = StepMeter(trainer.layout, trainer.compute_dtype, 1, trainer.deployer)  # nothing read yet
    t0 = time.perf_counter()
    meter.cost(trainer._state, batch, trainer.progress.train_key)
    read_cost_s = time.perf_counter() - t0

    times = {False: [], True: []}
    for _ in range(args.repeats):
        for grad_norm, trainer in trainers.items():
            times[grad_norm].append(epoch(trainer))
    base, logged = statistics.median(times[False]), statistics.median(times[True])
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}, dp 4 x mp 2, "
          f"{args.steps} steps per epoch, metrics pulled every {args.log_every}, "
          f"{args.repeats} alternating epochs each")
    print(f"step time without gradient norm: {base * 1e3:.2f} ms; with: {logged * 1e3:.2f} ms; "
          f"ratio {logged / base:.3f}")
    print(f"reading the compiled step's FLOPs once (a cache hit after the first step): "
          f"{read_cost_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
