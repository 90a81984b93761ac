"""Run every paradigm example in examples/ as a user does and print the README's table of them:
paradigm, lines (redcoast's main.py vs redco's example for the same paradigm), the metrics the
run reached, and its wall time.

    python benchmarks/examples_table.py [--full] [name ...]

Default: each example's --tiny mode (what CI runs); --full: the example's own defaults. redco's
line counts are its example's main.py plus the modules its training uses (not the
save_init_ckpt / inference scripts), from github.com/tanyuqian/redco at v0.4.23's examples.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from example_runner import ROOT, run_example  # noqa: E402

# example folder: (paradigm, redco's example, its lines)
EXAMPLES = {
    "language_modeling": ("causal LM fine-tuning (SmolLM2-135M)", "language_modeling", 129),
    "text_to_text": ("seq2seq (T5, beam search, ROUGE)", "text_to_text", 196),
    "classification": ("sentence classification / regression (MiniLM)", "classification_regression", 179),
    "image_classification": ("CNN image classifier (digits)", "mnist", 108),
    "image_to_text": ("image captioning (ViT + GPT-2)", "image_to_text", 206),
    "lora": ("LoRA, frozen base (SmolLM2-135M)", "lora", 230 + 32),
    "meta_learning": ("MAML (sine regression)", "meta_learning", 198),
    "federated_learning": ("FedAvg (digits, non-IID clients)", "faderated_learning", 157 + 140 + 56),
    "ppo": ("PPO (CartPole-v1)", "reinforcement_learning/ppo_*", 82 + 63 + 170),
    "ddpg": ("DDPG (Pendulum-v1)", "reinforcement_learning/ddpg_*", 85 + 94 + 159),
    "dp_sgd": ("DP-SGD (per-example clipping, RDP accountant)", "differential_private_training", 126 + 88),
    # post-training: redco has no such example (None); the README gives TRL's scripts' lengths
    "sft": ("SFT on chat data, padded vs packed", None, None),
    "dpo": ("DPO / SimPO, frozen reference", None, None),
    "grpo": ("GRPO, verifiable reward, sharded sampling", None, None),
}


def _format(metrics):
    def value(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    return ", ".join(f"{k} {value(v)}" for k, v in metrics.items()
                     if isinstance(v, (int, float, str)) and not isinstance(v, bool))


def main(argv):
    full = "--full" in argv
    names = [a for a in argv if not a.startswith("--")] or list(EXAMPLES)
    print("| example | paradigm | lines: redcoast / redco | metrics reached | time |")
    print("|---|---|---|---|---|")
    for name in names:
        paradigm, redco_name, redco_lines = EXAMPLES[name]
        lines = sum(1 for _ in open(ROOT / "examples" / name / "main.py"))
        metrics, seconds = run_example(name, tiny=not full, check_layout=False)
        print(f"| `{name}` | {paradigm} | {lines} / {redco_lines or '-'} | {_format(metrics)} | "
              f"{seconds:.0f} s |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
