"""redcoast's own models train through the Trainer: split over model shards (plan traced from
the loss, sibling matmuls fused) the updates equal those of one model shard."""

import jax
import numpy as np
import optax
import pytest

from redcoast import Deployer, Trainer
from redcoast.models import Model, llama, t5
from tiny_lm import assert_trees_close

V, T = 64, 8


def _lm_loss(model):
    def loss(rng, state, params, batch, is_training):
        logits = model.apply(params, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()
    return loss


def _t5_loss(model):
    def loss(rng, state, params, batch, is_training):
        ids = batch["ids"]
        logits = model.apply(params, ids[:, :-1], np.ones(ids[:, :-1].shape, np.int32), ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    return loss


MODELS = {
    # 4 query heads, 2 KV heads: on 2 shards Q, K, V are fused block-wise (different widths)
    "llama_gqa": (lambda: Model(llama.LlamaForCausalLM, llama.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)), _lm_loss),
    "t5": (lambda: Model(t5.T5ForConditionalGeneration, t5.Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False)), _t5_loss),
}


def _train(name, n_model_shards):
    make, loss = MODELS[name]
    model = make()
    rng = np.random.default_rng(0)
    examples = [{"ids": rng.integers(0, V, T + 1).astype(np.int32)} for _ in range(16)]
    collate = lambda rows: {"ids": np.stack([r["ids"] for r in rows])}  # noqa: E731
    deployer = Deployer(n_model_shards=n_model_shards, verbose=False)
    trainer = Trainer(deployer, collate, model.apply, loss(model), model.init(0),
                      optax.sgd(0.05, momentum=0.9), fuse_matmuls=True)
    # a global batch of 8 whatever the layout: two identical updates
    trainer.train(examples, per_device_batch_size=8 // deployer.n_data_shards, shuffle=False)
    return trainer


@pytest.mark.parametrize("name", list(MODELS))
def test_two_model_shards_train_like_one(name):
    one, two = _train(name, 1), _train(name, 2)
    split = [s for s in jax.tree_util.tree_leaves(two.plan.param_specs) if "mp" in str(s)]
    assert split, "nothing was split over the model shards"
    assert_trees_close(two.params, one.params)


def test_more_model_shards_than_kv_heads_split_the_query_heads():
    # 4 query / 2 KV heads on 4 shards: grouped K/V cannot be split, so attention repeats them
    # per query head and the query heads are split (without: Q, K, V, O all replicated)
    one, four = _train("llama_gqa", 1), _train("llama_gqa", 4)
    split = {pl.path[-2]: "mp" in pl.spec for pl in four.plan.compute_placements
             if pl.path[:3] == ("layers", "0", "self_attn") and pl.path[-1] == "kernel"}
    assert split == {"q_proj": True, "k_proj": False, "v_proj": False, "o_proj": True}
    assert_trees_close(four.params, one.params)
