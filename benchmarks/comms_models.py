"""Per-layer model-parallel traffic and parameter memory of redcoast's own models, trained through
the Trainer (its plan traced from the loss, its sibling-matmul fusion, its compiled step).

For each model in redcoast.models (tiny configs: hidden 64, 8 heads, vocabulary 128, sequence 8,
global batch 8; ViT: 12x12 images in 4x4 patches, 10 tokens) and 2, 4, 8 model shards on 8 simulated CPU devices: compile the Trainer's training
step at two depths and difference its collectives (redcoast/layout/comms.py). 'mp / Megatron' is the
per-layer 'mp' wire bytes over Megatron-LM's (2 all-reduces of the [batch, seq, hidden] activation
forward and 2 backward; a T5, BART or ViT + GPT-2 layer counts one encoder and one decoder layer:
2 + 3 each way, each at its own sequence length). GPT-J's parallel block is held to the same
2 + 2 (Megatron's layout for it needs 1 + 1: the attention and MLP outputs are summed before one
all-reduce, and their input gradients likewise).
'params / ideal' is parameter bytes per device over (split bytes / n + replicated bytes, K/V kept by
groups of shards / groups), FSDP off.

    python benchmarks/comms_models.py [model ...]
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from redcoast.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from redcoast import Deployer, Trainer  # noqa: E402
from redcoast.layout.comms import megatron_ideal, per_layer  # noqa: E402
from redcoast.models import (Model, bart, bert, gpt2, gptj, llama, opt, t5, vision_encoder_decoder,  # noqa: E402
                             vit)

B, T, H, HEADS, V = 8, 8, 64, 8, 128
IMAGE, PATCH = 12, 4  # ViT: 9 patches + the class token
VIT_T = 1 + (IMAGE // PATCH) ** 2


def _lm_loss(model):
    def loss(rng, state, params, batch, is_training):
        logits = model.apply(params, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()
    return loss


def _lm_loss_masked(model):  # the attention mask an input of the step, as with padded batches
    def loss(rng, state, params, batch, is_training):
        logits = model.apply(params, batch["ids"][:, :-1], batch["mask"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()
    return loss


def _bert_loss(model):
    def loss(rng, state, params, batch, is_training):
        ids = batch["ids"][:, :-1]
        hidden, pooled = model.apply(params, ids, np.ones(ids.shape, np.int32))
        return (hidden ** 2).mean() + (pooled ** 2).mean()
    return loss


def _t5_loss(model):
    def loss(rng, state, params, batch, is_training):
        ids = batch["ids"]
        logits = model.apply(params, ids[:, :-1], np.ones((B, T), np.int32), ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    return loss


def _seq2seq_loss(model):  # BART: the targets shifted right as decoder inputs
    return _t5_loss(model)


def _vit_loss(model):
    def loss(rng, state, params, batch, is_training):
        hidden, pooled = model.apply(params, batch["pixels"])
        return (hidden ** 2).mean() + (pooled ** 2).mean()
    return loss


def _caption_loss(model):
    def loss(rng, state, params, batch, is_training):
        ids = batch["ids"]
        logits = model.apply(params, batch["pixels"], ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    return loss


def vit_config(layers):
    return vit.Config(hidden_size=H, num_hidden_layers=layers, num_attention_heads=HEADS,
                      intermediate_size=2 * H, image_size=IMAGE, patch_size=PATCH)


def opt_proj_model(layers):  # opt-350m's layout: post-LN, embeddings projected in and out
    return Model(opt.OPTForCausalLM, opt.Config(
        vocab_size=V, max_position_embeddings=16, hidden_size=H, num_hidden_layers=layers,
        num_attention_heads=HEADS, ffn_dim=2 * H, do_layer_norm_before=False,
        word_embed_proj_dim=H // 2))


def llama_model(layers, kv_heads):
    return Model(llama.LlamaForCausalLM, llama.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=kv_heads))


MODELS = {  # name: (make(layers) -> Model, loss maker, cross-attention layers)
    "llama": (lambda n: llama_model(n, HEADS), _lm_loss, False),
    "llama_gqa4": (lambda n: llama_model(n, 4), _lm_loss, False),
    "gpt2": (lambda n: Model(gpt2.GPT2LMHeadModel, gpt2.Config(
        vocab_size=V, n_positions=16, n_embd=H, n_layer=n, n_head=HEADS)), _lm_loss, False),
    # GPT-2's own vocabulary (50257) divides no shard count: here 127 tokens, the ids below 127
    "gpt2_odd_vocab": (lambda n: Model(gpt2.GPT2LMHeadModel, gpt2.Config(
        vocab_size=V - 1, n_positions=16, n_embd=H, n_layer=n, n_head=HEADS)), _lm_loss, False),
    "bert": (lambda n: Model(bert.BertModel, bert.Config(
        vocab_size=V, hidden_size=H, num_hidden_layers=n, num_attention_heads=HEADS,
        intermediate_size=2 * H, max_position_embeddings=16)), _bert_loss, False),
    "t5": (lambda n: Model(t5.T5ForConditionalGeneration, t5.Config(
        vocab_size=V, d_model=H, d_kv=H // HEADS, d_ff=2 * H, num_layers=n, num_heads=HEADS)),
        _t5_loss, True),
    "gptj": (lambda n: Model(gptj.GPTJForCausalLM, gptj.Config(
        vocab_size=V, n_positions=16, n_embd=H, n_layer=n, n_head=HEADS, rotary_dim=4,
        n_inner=2 * H)), _lm_loss, False),
    "opt": (lambda n: Model(opt.OPTForCausalLM, opt.Config(
        vocab_size=V, max_position_embeddings=16, hidden_size=H, num_hidden_layers=n,
        num_attention_heads=HEADS, ffn_dim=2 * H)), _lm_loss, False),
    "opt_masked": (lambda n: Model(opt.OPTForCausalLM, opt.Config(
        vocab_size=V, max_position_embeddings=16, hidden_size=H, num_hidden_layers=n,
        num_attention_heads=HEADS, ffn_dim=2 * H)), _lm_loss_masked, False),
    "opt_proj": (lambda n: opt_proj_model(n), _lm_loss, False),
    # the same traced with its attention mask as an input (positions no longer constants)
    "opt_proj_masked": (lambda n: opt_proj_model(n), _lm_loss_masked, False),
    "bart": (lambda n: Model(bart.BartForConditionalGeneration, bart.Config(
        vocab_size=V, max_position_embeddings=16, d_model=H, encoder_layers=n, decoder_layers=n,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * H,
        decoder_ffn_dim=2 * H)), _seq2seq_loss, True),
    "vit": (lambda n: Model(vit.ViTModel, vit_config(n)), _vit_loss, False),
    "vit_gpt2": (lambda n: Model(vision_encoder_decoder.VisionEncoderDecoderModel,
                                 vision_encoder_decoder.Config(encoder=vit_config(n), decoder=gpt2.Config(
                                     vocab_size=V, n_positions=16, n_embd=H, n_layer=n, n_head=HEADS))),
                 _caption_loss, True),
}
# the sequence length of the encoder layers where it is not T
ENCODER_SEQ = {"vit": VIT_T, "vit_gpt2": VIT_T}


def _collate(examples):  # compile_train_step is given batches, never examples
    raise AssertionError("not called")


def trainer_for(name, layers, n):
    make, loss, _ = MODELS[name]
    model = make(layers)
    deployer = Deployer(n_model_shards=n, verbose=False)
    params = model.init(0)
    return Trainer(deployer, _collate, model.apply, loss(model), params, optax.sgd(0.1), fsdp=False,
                   fuse_matmuls=True)


def batch():
    rng = np.random.default_rng(0)
    return {"ids": rng.integers(0, V - 1, (B, T + 1)).astype(np.int32),
            "pixels": rng.standard_normal((B, 3, IMAGE, IMAGE)).astype(np.float32),
            "mask": np.ones((B, T), np.int32)}


def measure(name, n):
    trainers = {}

    def compiled(depth):
        trainers[depth] = trainer_for(name, depth, n)
        return trainers[depth].compile_train_step(batch())

    layer = per_layer(compiled, Deployer(n_model_shards=n, verbose=False).mesh)
    per_device = B // (jax.device_count() // n)
    ideal = megatron_ideal(per_device, ENCODER_SEQ.get(name, T), H, n)["wire_bytes"]
    if MODELS[name][2]:  # one encoder + one decoder layer per depth step
        ideal += megatron_ideal(per_device, T, H, n, cross_attention=True)["wire_bytes"]
    plan = trainers[2].plan
    # bytes per device if only the model axis split them: K/V kept by groups count 1/groups
    ideal_bytes = sum(pl.bytes_per_device({"mp": n}) for pl in plan.placements)
    on_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(trainers[2].params))
    mp = layer.get("mp", {"count": 0, "wire_bytes": 0})
    return mp["count"], mp["wire_bytes"] / ideal, on_device / ideal_bytes


def main(names):
    print(f"{'model':<12}{'mp':>3}  {'mp collectives/layer':>20}  {'mp / Megatron':>13}  {'params / ideal':>14}")
    t0 = time.perf_counter()
    for name in names:
        for n in (2, 4, 8):
            count, ratio, mem = measure(name, n)
            print(f"{name:<12}{n:>3}  {count:>20g}  {ratio:>12.3f}x  {mem:>13.3f}x", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s; jax {jax.__version__}, {jax.device_count()} CPU devices)")


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODELS))
