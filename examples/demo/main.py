"""redcoast demo: train a small transformer language model on 8 simulated CPU devices.

    python examples/demo/main.py

The model learns two character-level tasks from scratch ("sort: qzkd -> dkqz", "add: 47+38 -> 85")
and is scored on prompts it never saw. It is split over 2 devices (tensor parallel) and copied 4
times (data parallel); redcoast chooses where every parameter lives and prints the plan. Nothing
is downloaded: the data is generated, and the run takes 1-2 minutes on a 2-core CPU.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from redcoast import Deployer, Trainer
from redcoast.simulate import simulate_cpu_devices

import data
from model import TransformerLM

# Simulate 8 devices on the CPU (before JAX's first computation); set JAX_PLATFORMS yourself
# to run on accelerators instead.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    simulate_cpu_devices(8)

N_TRAIN, N_EVAL = 16_000, 512
PER_DEVICE_BATCH_SIZE = 16
N_EPOCHS = 5
LEARNING_RATE = 3e-3

model = TransformerLM(vocab_size=data.VOCAB_SIZE, max_len=data.SEQ_LEN)


def collate_fn(examples):
    """Examples -> token ids, next-token targets, a mask over the answer, prompt lengths."""
    ids = np.full((len(examples), data.SEQ_LEN + 1), data.PAD, np.int32)
    answer_mask = np.zeros((len(examples), data.SEQ_LEN), np.float32)
    prompt_len = np.zeros(len(examples), np.int32)
    for i, ex in enumerate(examples):
        prompt, answer = data.encode(ex["prompt"]), data.encode(ex["answer"]) + [data.EOS]
        ids[i, :len(prompt) + len(answer)] = prompt + answer
        answer_mask[i, len(prompt) - 1:len(prompt) + len(answer) - 1] = 1.0
        prompt_len[i] = len(prompt)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "answer_mask": answer_mask,
            "prompt_len": prompt_len}


def loss_fn(rng, state, params, batch, is_training):
    """Cross-entropy over the answer tokens (the prompts are random, so they are not learned)."""
    logits = state.apply_fn({"params": params}, batch["input_ids"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    correct = jnp.argmax(logits, -1) == batch["targets"]
    mask = batch["answer_mask"]
    return jnp.sum(losses * mask) / jnp.sum(mask), {"acc": jnp.sum(correct * mask) / jnp.sum(mask)}


def pred_fn(rng, params, batch):
    """Greedy completion of every prompt: generated ids of shape (batch, MAX_ANSWER_LEN)."""
    prompt_len = batch["prompt_len"][:, None]
    positions = jnp.arange(data.SEQ_LEN)[None]
    tokens = jnp.where(positions < prompt_len, batch["input_ids"], data.PAD)

    def generate_one(t, tokens):  # no KV cache: rerun the fixed-length buffer at every step
        logits = model.apply({"params": params}, tokens)
        last = jnp.take_along_axis(logits, (prompt_len + t - 1)[..., None], axis=1)[:, 0]
        return jnp.where(positions == prompt_len + t, jnp.argmax(last, -1)[:, None], tokens)

    tokens = jax.lax.fori_loop(0, data.MAX_ANSWER_LEN, generate_one, tokens)
    return jnp.take_along_axis(tokens, prompt_len + jnp.arange(data.MAX_ANSWER_LEN)[None], axis=1)


def decode_batch(generated_ids):
    """The predictor's output_fn: a batch of generated ids -> one string per example."""
    return [data.decode(row) for row in generated_ids]


def exact_match(examples, completions):
    """The fraction of completions equal to the expected answer, per task."""
    hits = {}
    for ex, completion in zip(examples, completions):
        task = ex["prompt"].split(":")[0]
        hits.setdefault(f"exact_{task}", []).append(completion == ex["answer"])
    return {name: float(np.mean(h)) for name, h in hits.items()}


def show_completions(title, predictor, params, examples):
    print(f"\n{title}")
    for ex, completion in zip(examples, predictor.predict(examples, PER_DEVICE_BATCH_SIZE, params)):
        verdict = "ok" if completion == ex["answer"] else f"wrong, expected {ex['answer']}"
        print(f"  {ex['prompt'] + completion:<28} {verdict}")


def main():
    deployer = Deployer(jax_seed=42, n_model_shards=2, workdir=os.path.join("workdir", "demo"))
    train_examples, eval_examples = data.make_examples(N_TRAIN, N_EVAL)

    params = model.init(deployer.gen_rng(), jnp.zeros((1, data.SEQ_LEN), jnp.int32))["params"]
    lr_schedule_fn = deployer.get_lr_schedule_fn(
        train_size=len(train_examples), per_device_batch_size=PER_DEVICE_BATCH_SIZE,
        n_epochs=N_EPOCHS, learning_rate=LEARNING_RATE, warmup_rate=0.05, schedule_type="cosine")
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=model.apply,
                      loss_fn=loss_fn, params=params, lr_schedule_fn=lr_schedule_fn,
                      optimizer=optax.adamw(lr_schedule_fn, weight_decay=0.01))
    predictor = trainer.get_default_predictor(pred_fn=pred_fn, output_fn=decode_batch)

    shown = eval_examples[:8]
    show_completions("Before training:", predictor, trainer.params, shown)
    trainer.fit(train_examples, per_device_batch_size=PER_DEVICE_BATCH_SIZE, n_epochs=N_EPOCHS,
                eval_examples=eval_examples, eval_predictor=predictor, eval_metric_fn=exact_match)
    show_completions("After training (held-out prompts):", predictor, trainer.params, shown)


if __name__ == "__main__":
    main()
