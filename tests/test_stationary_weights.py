"""FSDP-split weights the step leaves to the partitioner where the activations they read, gathered
over 'dp', are smaller than their model-shard share (redcoast/sharding/stationary_weights.py)."""

import jax
import numpy as np
import optax

from redcoast import Deployer, Trainer
from redcoast.models import model_from_config
from redcoast.sharding.paths import leaves_with_paths, path_to_str
from redcoast.sharding.rewrite_plan import RewritePlan
from redcoast.sharding.stationary_weights import left_to_partitioner

# 8 rows of 32 tokens: 256 rows a step. On 2 model shards Q/K/V (128 or fewer columns a shard),
# O and the MLP's down projection (256 columns, their inputs split) weigh at most the rows they
# read; gate and up (1024 columns a shard) and the untied head (2048) weigh more
LLAMA = dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=2048,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, tie_word_embeddings=False)
ROWS, SEQ = 8, 32


def _trainer(model, params):
    def lm_loss(rng, state, p, batch, is_training):
        logits = model.apply(p, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()
    return Trainer(Deployer(n_model_shards=2, verbose=False), lambda rows: {"ids": np.stack(rows)},
                   model.apply, lm_loss, params, optax.adamw(1e-3), fsdp=True), lm_loss


def _setup():
    model, _ = model_from_config(LLAMA)
    params = model.init(0)
    ids = np.random.default_rng(0).integers(0, LLAMA["vocab_size"], (ROWS, SEQ + 1)).astype(np.int32)
    return model, params, ids


def test_the_weights_heavier_than_the_rows_they_read_are_left_and_the_step_trains_the_same():
    # what the step gains (less memory, fewer bytes over 'dp' under the GPU compiler) is checked
    # in tests/test_plan_targets.py; here: which weights, and the step's numbers against one device
    model, params, ids = _setup()
    trainer, lm_loss = _trainer(model, params)
    trainer.compile_train_step({"ids": ids})
    weights = RewritePlan.from_sharding_plan(trainer.plan).leaf_splits(leaves_with_paths(params))
    closed = jax.make_jaxpr(lambda p: lm_loss(None, None, p, {"ids": ids}, True))(params)
    left = {path_to_str(weights[i].path) for i in left_to_partitioner(closed, weights, 2)}
    want = {f"layers/{k}/mlp/{name}/kernel" for k in range(2) for name in ("gate_proj", "up_proj")}
    assert left == want | {"lm_head/kernel"}
    trainer.check_layout(list(ids), per_device_batch_size=ROWS // 4)  # raises where they differ
