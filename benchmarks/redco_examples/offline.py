"""What the adapted redco examples share to run offline: simulated devices, a word-level tokenizer
built on the spot (instead of a hub tokenizer), and the library chosen by RUN_ON."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RUN_ON = os.environ.get("RUN_ON", "redcoast")   # "redcoast" or "redco"

WORDS = ["good", "bad", "great", "awful", "the", "a", "movie", "film", "was", "is", "very",
         "not", "plot", "actor", "story", "fun", "dull", "and", "but", "really"]


def word_tokenizer(words=WORDS, roberta_style=True):
    """A transformers fast tokenizer over ``words`` (special tokens as RoBERTa/T5 number them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    specials = ["<s>", "<pad>", "</s>", "<unk>"] if roberta_style else ["<pad>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + list(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if roberta_style:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", 0), ("</s>", 2)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                       pad_token="<pad>", unk_token="<unk>",
                                       model_input_names=["input_ids", "attention_mask"])
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_input_names=["input_ids", "attention_mask"])


def report(name, value):
    """The line the runner reads."""
    print(f"RESULT {name}={float(value):.6f}", flush=True)
