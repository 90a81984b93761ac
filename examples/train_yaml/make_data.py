"""Write the demo's task as files for ``redcoast train``: prompt/completion JSON Lines and a
tiny Llama (config.json and a character-level tokenizer.json, no weights: it starts fresh).

    python examples/train_yaml/make_data.py            # into examples/train_yaml/generated/
    redcoast train examples/train_yaml/run.yaml

The records are examples/demo's ("sort: qzkd -> " completed by "dkqz", "add: 47+38 -> " by
"85"); the tokenizer gives each character the id the demo uses (0 pad, 1 end, then the
characters), so the run is the demo's task written down as a file.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "demo"))
import data  # noqa: E402  (examples/demo/data.py)

HERE = os.path.dirname(os.path.abspath(__file__))
# A Llama small enough to learn the task in about a minute on 8 simulated CPU devices.
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
          "vocab_size": data.VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 192,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
          "bos_token_id": None, "eos_token_id": data.EOS, "pad_token_id": data.PAD}


def write_tokenizer(path):
    """A character-level tokenizer with the demo's ids (``tokenizers``' WordLevel model)."""
    import tokenizers

    vocab = {"<pad>": data.PAD, "</s>": data.EOS, "<unk>": 2 + len(data.CHARS)}
    vocab.update({c: data.encode(c)[0] for c in data.CHARS})
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex("."), behavior="isolated")  # every character a token, spaces too
    tokenizer.decoder = tokenizers.decoders.Fuse()
    tokenizer.add_special_tokens(["<pad>", "</s>", "<unk>"])
    tokenizer.save(path)


def write_jsonl(path, examples):
    with open(path, "w") as f:
        for ex in examples:
            f.write(json.dumps({"prompt": ex["prompt"], "completion": ex["answer"]}) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "generated"))
    parser.add_argument("--n-train", type=int, default=4000)
    parser.add_argument("--n-eval", type=int, default=256)
    args = parser.parse_args(argv)
    os.makedirs(os.path.join(args.out, "model"), exist_ok=True)
    train, valid = data.make_examples(args.n_train, args.n_eval, seed=0)
    write_jsonl(os.path.join(args.out, "train.jsonl"), train)
    write_jsonl(os.path.join(args.out, "eval.jsonl"), valid)
    with open(os.path.join(args.out, "model", "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)
    write_tokenizer(os.path.join(args.out, "model", "tokenizer.json"))
    print(f"wrote {len(train)} training and {len(valid)} eval records and a tiny Llama to "
          f"{args.out}")


if __name__ == "__main__":
    main()
