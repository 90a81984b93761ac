"""Sequence-to-sequence with T5: summarise generated records, decode by beam search, score ROUGE.

    pip install rouge-score
    python examples/text_to_text/main.py

Each input is a record whose fields come in random order ("job : baker | city : oslo | name :
ana | hobby : chess | age : 31"); its summary is one sentence ("ana , a baker from oslo , likes
chess"). A small T5 (redcoast.models.t5, relative attention, gated-GELU) is trained from scratch
on word-level tokens, split over 2 (simulated) devices and copied 4 times. The predictor decodes
with beam search (redcoast.models.generate_seq2seq) and the summaries are scored with ROUGE
(rouge-score) against the untrained model's. Nothing is downloaded.
"""

import argparse
import json
import os

import jax.numpy as jnp
import numpy as np
import optax

from redcoast import Deployer, Trainer
from redcoast.models import Model, t5
from redcoast.models.generate_seq2seq import generate
from redcoast.simulate import simulate_cpu_devices

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # 8 simulated devices unless you choose others
if os.environ["JAX_PLATFORMS"] == "cpu":
    simulate_cpu_devices(8)

FIELDS = {
    "name": ["ana", "bo", "chen", "dara", "eli", "fatou", "goran", "hana", "ivo", "jun", "kofi"],
    "job": ["baker", "pilot", "nurse", "farmer", "judge", "potter", "tailor", "chemist"],
    "city": ["oslo", "lima", "cairo", "quito", "hanoi", "dakar", "perth", "riga", "bern"],
    "hobby": ["chess", "golf", "rowing", "poetry", "karate", "origami", "baking"],
    "age": [str(a) for a in range(18, 80)],
}
PAD, EOS = 0, 1  # T5's conventions: the decoder also starts from PAD
WORDS = ["<pad>", "</s>", "|", ":", ",", "a", "from", "likes", "aged", *FIELDS,
         *sorted({w for values in FIELDS.values() for w in values})]
TOKEN = {w: i for i, w in enumerate(WORDS)}
SRC_LEN, TGT_LEN = 16, 12


def make_examples(n, seed):
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        record = {k: str(rng.choice(v)) for k, v in FIELDS.items()}
        order = rng.permutation(list(FIELDS))
        source = " | ".join(f"{k} : {record[k]}" for k in order)
        target = (f"{record['name']} , a {record['job']} from {record['city']} , aged "
                  f"{record['age']} , likes {record['hobby']}")
        examples.append({"source": source, "target": target})
    return examples


def encode(text, length):
    ids = [TOKEN[w] for w in text.split()][:length - 1] + [EOS]
    return ids + [PAD] * (length - len(ids))


def decode(ids):
    words = []
    for i in ids:
        if i in (EOS, PAD):
            break
        words.append(WORDS[i])
    return " ".join(words)


def collate_fn(examples):
    src = np.array([encode(ex["source"], SRC_LEN * 2) for ex in examples], np.int32)
    labels = np.array([encode(ex["target"], TGT_LEN + 2) for ex in examples], np.int32)
    decoder_in = np.concatenate([np.full((len(examples), 1), PAD, np.int32), labels[:, :-1]], 1)
    return {"input_ids": src, "attention_mask": (src != PAD).astype(np.int32),
            "decoder_input_ids": decoder_in, "labels": labels}


def make_loss_fn(model):
    def loss_fn(rng, state, params, batch, is_training):
        logits = model.apply(params, batch["input_ids"], batch["attention_mask"],
                             batch["decoder_input_ids"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        # the labels' first EOS counts; the padding after it does not
        weights = (jnp.cumsum(batch["labels"] == EOS, axis=1) - (batch["labels"] == EOS)) == 0
        return jnp.sum(losses * weights) / jnp.sum(weights)
    return loss_fn


def make_pred_fn(model, num_beams):
    def pred_fn(rng, params, batch):
        return generate(model, params, batch["input_ids"], batch["attention_mask"],
                        max_new_tokens=TGT_LEN + 2, num_beams=num_beams)
    return pred_fn


def rouge(examples, predictions):
    """Mean ROUGE-1/2/L F1 (rouge-score) of the decoded summaries against the references."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"])
    scores = [scorer.score(ex["target"], pred) for ex, pred in zip(examples, predictions)]
    return {name: float(np.mean([s[name].fmeasure for s in scores]))
            for name in ("rouge1", "rouge2", "rougeL")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a CI-sized run")
    parser.add_argument("--metrics-out", help="write the final metrics here as JSON")
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch (Trainer.check_layout)")
    parser.add_argument("--workdir", default=os.path.join("workdir", "text_to_text"))
    parser.add_argument("--n-model-shards", type=int, default=2)
    parser.add_argument("--num-beams", type=int, default=4)
    args = parser.parse_args()
    n_train, n_eval, n_epochs = (2048, 64, 3) if args.tiny else (20_000, 512, 5)
    per_device_batch_size = 16

    config = t5.Config(vocab_size=len(WORDS), d_model=64, d_kv=16, d_ff=128, num_layers=2,
                       num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                       decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=EOS)
    model = Model(t5.T5ForConditionalGeneration, config)
    deployer = Deployer(jax_seed=0, n_model_shards=args.n_model_shards, workdir=args.workdir)
    params = model.init(deployer.gen_rng())
    train, valid = make_examples(n_train, seed=0), make_examples(n_eval, seed=1)

    schedule = deployer.get_lr_schedule_fn(
        train_size=len(train), per_device_batch_size=per_device_batch_size, n_epochs=n_epochs,
        learning_rate=3e-3, warmup_rate=0.05, schedule_type="cosine")
    trainer = Trainer(deployer, collate_fn, model.apply, make_loss_fn(model), params,
                      optax.adamw(schedule, weight_decay=0.01), lr_schedule_fn=schedule)
    predictor = trainer.get_default_predictor(
        pred_fn=make_pred_fn(model, args.num_beams),
        output_fn=lambda ids: [decode(row) for row in ids])

    untrained = rouge(valid, predictor.predict(valid, per_device_batch_size, trainer.params))
    trainer.fit(train, per_device_batch_size=per_device_batch_size, n_epochs=n_epochs,
                eval_examples=valid, eval_predictor=predictor, eval_metric_fn=rouge,
                check_layout=args.check_layout)
    predictions = predictor.predict(valid, per_device_batch_size, trainer.params)
    metrics = {**rouge(valid, predictions), **{f"untrained_{k}": v for k, v in untrained.items()},
               "exact_match": float(np.mean([p == ex["target"] for ex, p in zip(valid, predictions)]))}
    print(json.dumps(metrics, indent=1))
    for ex, pred in list(zip(valid, predictions))[:3]:
        print(f"  {ex['source']}\n    -> {pred}")
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    main()
