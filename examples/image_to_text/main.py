"""Image captioning: a ViT encoder and a GPT-2 decoder (cross-attention) trained from scratch.

    python examples/image_to_text/main.py [--tiny] [--num-beams 2] [--metrics-out metrics.json]

The images are generated: a coloured shape on a noisy background, somewhere in the picture, and
the caption says what and where ("a red square on the left"), so nothing is downloaded. The model is
redcoast.models' ViT + GPT-2 (transformers' VisionEncoderDecoderModel layout) from a small random
config, split over 2 model shards (tensor parallel) times 4 data shards on 8 devices; captions are
generated with beam search at evaluation and scored by exact match and word accuracy, beside the
untrained model's.
"""

import argparse
import json
import os

from redcoast.simulate import simulate_cpu_devices

simulate_cpu_devices(8)  # CPU only, before JAX starts; an accelerator, if present, is used instead

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from redcoast import Deployer, Trainer  # noqa: E402
from redcoast.models import Model, gpt2, vit  # noqa: E402
from redcoast.models import vision_encoder_decoder as ved  # noqa: E402
from redcoast.models.generate_seq2seq import generate  # noqa: E402

IMAGE_SIZE, SHAPE_SIZE = 16, 8
COLOURS = {"red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1), "yellow": (1, 1, 0)}
SHAPES = ("square", "circle", "triangle", "cross")
PLACES = {"on the left": (8, 4), "on the right": (8, 12), "at the top": (4, 8),
          "at the bottom": (12, 8)}  # (row, column) of the shape's centre
WORDS = ["<s>", "<pad>", "a", "on", "the", "at", "left", "right", "top", "bottom",
         *COLOURS, *SHAPES]
BOS = EOS = 0  # GPT-2's convention: one token starts and ends a caption
PAD = 1
MAX_LEN = 7  # "a red square on the left" and EOS


def shape_mask(shape, size):
    """A boolean [size, size] stencil of ``shape``."""
    r, c = np.mgrid[:size, :size] - (size - 1) / 2
    half = size / 2
    return {"square": np.ones((size, size), bool),
            "circle": r ** 2 + c ** 2 <= half ** 2,
            "triangle": np.abs(c) <= (r + half) / 2,
            "cross": (np.abs(r) < half / 3) | (np.abs(c) < half / 3)}[shape]


def make_example(rng):
    """A random image [3, H, W] (channels first, as ViT takes it) and its caption."""
    colour, shape, place = (rng.choice(list(options)) for options in (COLOURS, SHAPES, PLACES))
    image = rng.uniform(0, 0.3, (IMAGE_SIZE, IMAGE_SIZE, 3))
    row, col = np.array(PLACES[place]) + rng.integers(-1, 2, 2)  # jitter by a pixel
    size = SHAPE_SIZE + rng.integers(-1, 1)
    top, left = row - size // 2, col - size // 2
    region = image[max(top, 0):top + size, max(left, 0):left + size]
    stencil = shape_mask(shape, size)[max(-top, 0):, max(-left, 0):][:region.shape[0], :region.shape[1]]
    region[stencil] = np.array(COLOURS[colour]) * rng.uniform(0.7, 1.0)
    return {"pixel_values": image.transpose(2, 0, 1).astype(np.float32),
            "caption": f"a {colour} {shape} {place}"}


def encode(caption):
    return [WORDS.index(w) for w in caption.split()] + [EOS]


def decode(ids):
    """Generated ids -> the caption (up to the first EOS; padding left out)."""
    words = []
    for i in ids:
        if i == EOS:
            break
        if i != PAD:
            words.append(WORDS[i])
    return " ".join(words)


def collate_fn(examples):
    """Images, the decoder's input (start token + caption) and its targets (caption + EOS)."""
    targets = np.full((len(examples), MAX_LEN), PAD, np.int32)
    mask = np.zeros((len(examples), MAX_LEN), np.int32)
    for i, ex in enumerate(examples):
        ids = encode(ex["caption"])
        targets[i, :len(ids)], mask[i, :len(ids)] = ids, 1
    inputs = np.concatenate([np.full((len(examples), 1), BOS, np.int32), targets[:, :-1]], axis=1)
    return {"pixel_values": np.stack([ex["pixel_values"] for ex in examples]),
            "decoder_input_ids": inputs, "decoder_attention_mask": mask, "labels": targets}


def loss_fn(rng, state, params, batch, is_training):
    logits = state.apply_fn(params, batch["pixel_values"], batch["decoder_input_ids"],
                            batch["decoder_attention_mask"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    mask = batch["decoder_attention_mask"]
    correct = logits.argmax(-1) == batch["labels"]
    return (losses * mask).sum() / mask.sum(), {"token_acc": (correct * mask).sum() / mask.sum()}


def caption_metrics(examples, captions):
    """Exact match of whole captions, and the fraction of reference words in their place."""
    exact, words = [], []
    for ex, caption in zip(examples, captions):
        want, got = ex["caption"].split(), caption.split()
        exact.append(got == want)
        words.append(np.mean([i < len(got) and got[i] == w for i, w in enumerate(want)]))
    return {"exact_match": float(np.mean(exact)), "word_accuracy": float(np.mean(words))}


def make_model(hidden=64, layers=2, heads=4):
    config = ved.Config(
        encoder=vit.Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                           intermediate_size=4 * hidden, image_size=IMAGE_SIZE, patch_size=4,
                           num_channels=3),
        decoder=gpt2.Config(vocab_size=len(WORDS), n_positions=MAX_LEN + 1, n_embd=hidden,
                            n_layer=layers, n_head=heads, bos_token_id=BOS, eos_token_id=EOS),
        pad_token_id=PAD)
    return Model(ved.VisionEncoderDecoderModel, config)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a CI-sized run (about a minute)")
    parser.add_argument("--metrics-out", help="write the final metrics here as JSON")
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch (Trainer.check_layout)")
    parser.add_argument("--workdir", default=os.path.join("workdir", "image_to_text"))
    parser.add_argument("--n-model-shards", type=int, default=2)
    parser.add_argument("--per-device-batch-size", type=int, default=16)
    parser.add_argument("--n-epochs", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--num-beams", type=int, default=2)
    args = parser.parse_args()
    n_train, n_epochs = (3072, args.n_epochs or 4) if args.tiny else (16384, args.n_epochs or 8)

    deployer = Deployer(jax_seed=42, n_model_shards=args.n_model_shards, workdir=args.workdir)
    rng = np.random.default_rng(0)
    train_examples = [make_example(rng) for _ in range(n_train)]
    eval_examples = [make_example(rng) for _ in range(256)]
    model = make_model()
    lr_schedule_fn = deployer.get_lr_schedule_fn(
        train_size=n_train, per_device_batch_size=args.per_device_batch_size, n_epochs=n_epochs,
        learning_rate=args.learning_rate, schedule_type="cosine", warmup_rate=0.1)
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=model.apply,
                      loss_fn=loss_fn, params=model.init(seed=0), lr_schedule_fn=lr_schedule_fn,
                      optimizer=optax.adamw(lr_schedule_fn, weight_decay=0.01))

    def pred_fn(rng, params, batch):
        return generate(model, params, batch["pixel_values"], max_new_tokens=MAX_LEN,
                        num_beams=args.num_beams)

    predictor = trainer.get_default_predictor(
        pred_fn=pred_fn, output_fn=lambda ids: [decode(row) for row in ids])

    def scores(params):
        captions = predictor.predict(eval_examples, args.per_device_batch_size, params)
        return captions, caption_metrics(eval_examples, captions)

    trainer.fit(train_examples, per_device_batch_size=args.per_device_batch_size,
                n_epochs=n_epochs, eval_examples=eval_examples, eval_predictor=predictor,
                eval_metric_fn=caption_metrics, resume=False, check_layout=args.check_layout)
    captions, trained = scores(trainer.params)
    _, untrained = scores(model.init(seed=0))  # the parameters training started from
    for ex, caption in list(zip(eval_examples, captions))[:6]:
        deployer.log_info(f"{caption!r:32} (true: {ex['caption']!r})")
    split = [s for s in jax.tree_util.tree_leaves(trainer.plan.param_specs) if "mp" in str(s)]
    metrics = {**trained, **{f"untrained_{k}": v for k, v in untrained.items()},
               "n_model_shards": deployer.n_model_shards, "n_data_shards": deployer.n_data_shards,
               "params_split": len(split)}
    deployer.log_info(json.dumps(metrics, indent=1), title="Final metrics")
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)


if __name__ == "__main__":
    main()
