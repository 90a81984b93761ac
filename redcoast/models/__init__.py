"""Reference models (Llama family, GPT-2, GPT-J, OPT, T5, BART, BERT, ViT, ViT + GPT-2) with
Hugging Face and GGUF weights, and generation. Depends on Flax; redcoast's core never imports it."""

from .base import Model
from .generate import generate, left_pad
from .gguf import from_gguf, packaged_gguf, read_gguf
from .peft import load_peft_adapters, save_peft_adapters
from .pretrained import from_pretrained, model_from_config, save_pretrained

__all__ = ["Model", "from_gguf", "from_pretrained", "generate", "left_pad", "load_peft_adapters",
           "model_from_config", "packaged_gguf", "read_gguf", "save_peft_adapters",
           "save_pretrained"]
