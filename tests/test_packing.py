"""Sequence packing (redcoast/text/packing.py) and packed rows in Llama: each packed sequence computes
exactly as it does alone, so a packed loss is the padded loss."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from redcoast.errors import ConfigError, DataError
from redcoast.models import Model, llama
from redcoast.models.layers import segment_positions
from redcoast.models.pretrained import model_from_config
from redcoast.text.packing import pack_sequences, packed_fraction

SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18], [19, 20, 21], [22],
             [23, 24, 25, 26]]


def test_whole_sequences_fill_rows_longest_first_and_nothing_crosses_a_boundary():
    rows = pack_sequences(SEQUENCES, seq_len=8, pad_id=0)
    # first fit, longest first: [7 + 1], [5 + 3], [4 + 2]
    assert [list(r["segment_ids"]) for r in rows] == [
        [1, 1, 1, 1, 1, 1, 1, 2], [1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 2, 2, 2, 2, 0, 0]]
    assert sorted(sorted(int(t) for t in r["input_ids"][r["segment_ids"] == s])
                  for r in rows for s in range(1, 3) if (r["segment_ids"] == s).any()) == \
        sorted(SEQUENCES)  # every token once, every sequence whole
    last = rows[2]
    assert list(last["input_ids"]) == [12, 13, 23, 24, 25, 26, 0, 0]  # kept in the given order
    assert list(last["positions"]) == [0, 1, 0, 1, 2, 3, 0, 0]
    assert list(last["targets"][:6]) == [13, 0, 24, 25, 26, 0]
    assert list(last["loss_mask"]) == [1, 0, 1, 1, 1, 0, 0, 0]  # no target across a boundary
    assert packed_fraction(rows) == pytest.approx(22 / 24)


def test_a_loss_mask_weights_the_predicted_token_and_bad_input_is_named():
    (row,) = pack_sequences([{"input_ids": [3, 4, 5, 6], "loss_mask": [0, 0, 1, 1]}], 6)
    assert list(row["loss_mask"]) == [0, 1, 1, 0, 0, 0]  # token t is weighted by t + 1's mask
    with pytest.raises(DataError, match="sequence 1 has 9 tokens, more than seq_len=8"):
        pack_sequences([[1], list(range(9))], 8)
    with pytest.raises(DataError, match="loss_mask has 2 entries for 3 tokens"):
        pack_sequences([{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}], 8)


def test_segment_positions_restart_at_each_segment():
    ids = jnp.array([[1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 3, 3]])
    np.testing.assert_array_equal(segment_positions(ids), [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]])


@pytest.fixture(scope="module")
def tiny_llama():
    model = Model(llama.LlamaForCausalLM, llama.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        initializer_range=0.2))
    return model, model.init(0)


# the other decoder families, from Hugging Face configs (weights large enough to tell apart)
DECODERS = {
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 32,
             "n_positions": 32, "initializer_range": 0.2},
    "opt": {"model_type": "opt", "hidden_size": 32, "word_embed_proj_dim": 32, "ffn_dim": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 32,
            "max_position_embeddings": 32, "init_std": 0.2},
    "gptj": {"model_type": "gptj", "n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4,
             "vocab_size": 32, "n_positions": 32, "initializer_range": 0.2},
}


@pytest.fixture(scope="module", params=["llama", *DECODERS])
def decoder(request, tiny_llama):
    if request.param == "llama":
        return tiny_llama
    model, _ = model_from_config(DECODERS[request.param])
    return model, model.init(0)


def test_packed_sequences_give_each_ones_own_logits(decoder):
    model, params = decoder
    rows = pack_sequences(SEQUENCES, seq_len=8)
    batch = {k: jnp.stack([r[k] for r in rows]) for k in rows[0]}
    packed = jax.jit(lambda p, ids, seg: model.apply(p, ids, segment_ids=seg))(
        params, batch["input_ids"], batch["segment_ids"])
    apply = jax.jit(model.apply)
    for r, row in enumerate(rows):
        for s in range(1, int(row["segment_ids"].max()) + 1):
            where = np.flatnonzero(row["segment_ids"] == s)
            alone = apply(params, jnp.asarray(row["input_ids"][where])[None])[0]
            np.testing.assert_allclose(packed[r, where], alone, rtol=1e-5, atol=1e-5,
                                       err_msg=f"row {r} segment {s}")


def test_the_packed_loss_and_gradient_equal_the_padded_ones(tiny_llama):
    model, params = tiny_llama

    def loss(params, batch, **kw):
        logits = model.apply(params, batch["input_ids"], **kw)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(per_token * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])

    def stacked(rows):
        return {k: jnp.stack([r[k] for r in rows]) for k in rows[0]}

    packed = stacked(pack_sequences(SEQUENCES, seq_len=8))
    # one sequence per row, right-padded: the baseline packing replaces
    padded = stacked([pack_sequences([s], seq_len=8)[0] for s in SEQUENCES])
    mask = lambda b: (b["segment_ids"] != 0).astype(jnp.int32)  # noqa: E731
    want, want_grad = jax.jit(jax.value_and_grad(
        lambda p: loss(p, padded, attention_mask=mask(padded))))(params)
    got, got_grad = jax.jit(jax.value_and_grad(
        lambda p: loss(p, packed, segment_ids=packed["segment_ids"])))(params)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for g, w in zip(jax.tree_util.tree_leaves(got_grad), jax.tree_util.tree_leaves(want_grad)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_segments_do_not_go_with_a_cache_or_a_mask(tiny_llama):
    model, params = tiny_llama
    ids = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ConfigError, match="segment_ids .* replace attention_mask"):
        model.apply(params, ids, attention_mask=jnp.ones((1, 4), jnp.int32),
                    segment_ids=jnp.ones((1, 4), jnp.int32))


def test_packed_rows_train_in_the_sharded_layout_as_on_one_device(tiny_llama):
    """Through a Trainer on 2 data x 4 model shards (fusion and FSDP as chosen): the layout's
    loss and gradients on packed rows equal one device's (Trainer.check_layout)."""
    from redcoast import Deployer, Trainer

    model, params = tiny_llama

    def loss_fn(rng, state, params, batch, is_training):
        logits = state.apply_fn(params, batch["input_ids"], segment_ids=batch["segment_ids"])
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(per_token * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])

    rows = pack_sequences([list(range(1 + i % 5, 2 + i % 5 + i % 7)) for i in range(24)], 16)
    collate = lambda rs: {k: np.stack([r[k] for r in rs]) for k in rs[0]}  # noqa: E731
    trainer = Trainer(Deployer(n_model_shards=4, verbose=False), collate, model.apply, loss_fn,
                      params, optax.sgd(0.1))
    assert trainer.check_layout(rows, per_device_batch_size=2, rtol=1e-5).ok
