"""The tasks, as text: sort the letters of a word, or add two numbers, one character at a time.

    sort: qzkd -> dkqz
    add: 47+38 -> 85
"""

import random
import string

PAD, EOS = 0, 1
CHARS = " :->+" + string.digits + string.ascii_lowercase
VOCAB_SIZE = 48  # pad, end-of-sequence, 43 characters; rounded up so model shards divide it
SEQ_LEN = 32  # longest prompt (18) + longest answer with EOS (9), rounded up
MAX_ANSWER_LEN = 9


def encode(text):
    """Token ids of a string (no EOS)."""
    return [2 + CHARS.index(c) for c in text]


def decode(ids):
    """The string spelled by ``ids`` up to the first EOS or PAD ('?' for unused ids)."""
    out = []
    for i in ids:
        if i in (PAD, EOS):
            break
        out.append(CHARS[i - 2] if i - 2 < len(CHARS) else "?")
    return "".join(out)


def sort_example(rng):
    word = "".join(rng.sample(string.ascii_lowercase, rng.randint(3, 8)))
    return {"prompt": f"sort: {word} -> ", "answer": "".join(sorted(word))}


def add_example(rng):
    a, b = rng.randrange(100), rng.randrange(100)
    return {"prompt": f"add: {a}+{b} -> ", "answer": str(a + b)}


def make_examples(n_train, n_eval, seed=0):
    """Disjoint train and eval lists of ``{"prompt": ..., "answer": ...}``, half of each task."""
    rng = random.Random(seed)
    eval_examples = [(sort_example if i % 2 else add_example)(rng) for i in range(n_eval)]
    held_out = {ex["prompt"] for ex in eval_examples}
    train_examples = []
    while len(train_examples) < n_train:
        ex = (sort_example if len(train_examples) % 2 else add_example)(rng)
        if ex["prompt"] not in held_out:
            train_examples.append(ex)
    return train_examples, eval_examples
