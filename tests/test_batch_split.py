"""Matmuls of weights kept whole over the model shards run on a share of the batch per model shard
(redcoast/sharding/batch_split.py, issue 51): SmolLM2's 9 heads over 4 model shards."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from redcoast import Deployer, Trainer
from redcoast.layout import steps
from redcoast.models import Model, llama
from redcoast.sharding import batch_split, weight_origins
from redcoast.sharding.paths import leaves_with_paths
from redcoast.sharding.rewrite_plan import RewritePlan
from test_device_bound import vendor_attention

BATCH, SEQ = 8, 16


def smollm2_shaped(layers=2, seq=SEQ):
    """SmolLM2-135M's attention (hidden 576, 9 heads of 64, 3 K/V heads) with a narrow MLP."""
    return Model(llama.LlamaForCausalLM, llama.LlamaConfig(
        vocab_size=128, hidden_size=576, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=seq))


def lm_loss(model):
    def loss(rng, state, params, batch, is_training):
        logits = model.apply(params, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()
    return loss


def rows(n=BATCH, seq=SEQ):
    rng = np.random.default_rng(0)
    return [{"ids": rng.integers(0, 128, seq + 1).astype(np.int32)} for _ in range(n)]


def collate(rs):
    return {"ids": np.stack([r["ids"] for r in rs])}


def trainer(model, n_model_shards=4):
    return Trainer(Deployer(n_model_shards=n_model_shards, jax_seed=0, verbose=False), collate,
                   model.apply, lm_loss(model), model.init(0), optax.sgd(0.1))


def chosen_matmuls(model, trainer_, flops_per_byte, batch_rows=None):
    """(the matmuls the rewrite would split, what its walk found) in ``model``'s traced loss
    of ``batch_rows`` (``rows()`` if None)."""
    params = trainer_.params
    plan = RewritePlan.from_sharding_plan(trainer_.plan)
    batch = collate(batch_rows or rows())
    closed = jax.make_jaxpr(lambda p: lm_loss(model)(None, None, p, batch, True))(params)
    origins = weight_origins.of_weights(plan.leaf_splits(leaves_with_paths(params)))
    found = batch_split._Found()
    batch_split._walk(closed.jaxpr, weight_origins.propagate(closed.jaxpr, origins),
                      [batch_split.NOTHING] * len(origins), found,
                      batch_split.shards_of(trainer_.mesh), len(batch["ids"]))
    return batch_split.worth_splitting(found, trainer_.mesh, flops_per_byte), found


def test_the_matmuls_of_heads_that_do_not_divide_are_chosen_where_the_compute_pays():
    model = smollm2_shaped()
    t = trainer(model)
    t.compile_train_step(collate(rows()))  # the plan from the traced loss
    whole = {"/".join(pl.path) for pl in t.plan.compute_placements if "mp" not in str(pl.spec)}
    assert {f"layers/0/self_attn/{n}_proj/kernel" for n in "qkvo"} <= whole
    chosen, found = chosen_matmuls(model, t, flops_per_byte=667)  # CPU's rate
    # Q, K, V and O of both layers, and the LM head, which the plan keeps whole too (a
    # vocabulary of 128: not worth splitting); the MLP is split over the model shards
    assert len(chosen) == 9 and not found.met
    # gathered for a split matmul: O's outputs (the MLP reads them); Q, K and V feed O, and
    # the logits the loss
    assert len(found.gathered & set(found.matmuls)) == 2
    # between them: each layer's scores (Q against K) and values (the scores against V)
    assert len(found.between) == 4 and not found.by_position  # 8 rows: one a device
    # FLOPs saved per token (the projections', the scores' and values' over SEQ positions),
    # x3 for the backward pass, against the bytes (fp32) of the exits gathered forward and
    # scattered backward: a platform whose link byte costs more keeps all
    saved = 3 * 2 * 576 * (2 * (576 + 192 + 192 + 576) + 128 + 2 * 2 * SEQ)
    moved = 2 * 4 * (2 * 576)
    assert not chosen_matmuls(model, t, flops_per_byte=1.01 * saved / moved)[0]
    assert len(chosen_matmuls(model, t, flops_per_byte=0.99 * saved / moved)[0]) == len(chosen)


def flops_of(compiled):
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def eval_flops(t, batch_rows=None):
    layout, batch = t.layout, collate(batch_rows or rows())
    mask = np.ones(len(batch["ids"]), bool)
    batch, mask = (jax.device_put(x, layout.eval_batch_sharding) for x in (batch, mask))
    return flops_of(layout.eval_step.lower(t.state, batch, mask, jax.random.key(0)).compile())


@pytest.mark.slow  # two compiled steps, their evaluations and a layout check: ~30 s
def test_split_by_batch_the_step_computes_a_quarter_of_the_attention_and_trains_as_one_device(
        monkeypatch):
    model = smollm2_shaped()
    t = trainer(model)
    flops = flops_of(t.compile_train_step(collate(rows())))
    monkeypatch.setattr(steps, "flops_per_link_byte", lambda mesh: float("inf"))
    repeating = trainer(model)
    repeated = flops_of(repeating.compile_train_step(collate(rows())))
    repeated_eval = eval_flops(repeating)
    monkeypatch.undo()
    # per device, on 2 x 4: Q/K/V/O on a quarter of each data shard's rows instead of all of them
    qkvo = 2 * 2 * 576 * (576 + 192 + 192 + 576) * (BATCH // 2) * SEQ  # layers, forward
    # measured: 7.58e8 -> 2.13e8, 1.07x the Q/K/V/O share saved (the whole LM head's too)
    assert repeated - flops >= 3 * qkvo * (1 - 1 / 4), (repeated, flops)
    # the evaluation too (measured 2.49e8 -> 6.77e7), and its loss is one device's
    split_eval = eval_flops(t)
    assert repeated_eval - split_eval >= qkvo * (1 - 1 / 4), (repeated_eval, split_eval)
    # (batches of 8 rows both: 4 per data shard of 2 x 4, 1 per device of 8 x 1)
    np.testing.assert_allclose(t.eval_loss(rows(), BATCH // 2),
                               trainer(model, 1).eval_loss(rows(), BATCH // 8), rtol=1e-5)
    report = t.check_layout(rows(), BATCH // 2)
    assert report.ok and report.compared == "gradients"


FEW, LONG = 4, 512  # 2 sequences a data shard of 2 x 4: neither they nor 9 heads divide by 4


def test_too_few_sequences_to_split_the_heads_are_split_by_positions_where_that_pays():
    model = smollm2_shaped(seq=LONG)
    t = trainer(model)
    t.compile_train_step(collate(rows(FEW, LONG)))
    chosen, found = chosen_matmuls(model, t, flops_per_byte=667, batch_rows=rows(FEW, LONG))
    # Q, K, V, O of both layers and the LM head, split by positions over the model shards;
    # their 4 scores and values between them follow
    assert len(chosen) == 9 and found.by_position == set(found.matmuls) == chosen
    assert len(found.between) == 4 and not found.met
    # the positions' split moves every one's output (K and V gathered for the scores; Q's
    # counted too, which the rule cannot tell from them): per token, fp32, forward and back
    saved = 3 * 2 * 576 * (2 * (576 + 192 + 192 + 576) + 128 + 2 * 2 * LONG)
    moved = 2 * 4 * (2 * (576 + 192 + 192 + 576) + 128)
    assert 667 < saved / moved  # at seq 512; at 256 it would not pay on CPU (570)
    for rate, n in ((1.01 * saved / moved, 0), (0.99 * saved / moved, 9)):
        assert len(chosen_matmuls(model, t, rate, batch_rows=rows(FEW, LONG))[0]) == n
    # 511 positions (a batch's ids shifted by one) split unevenly, XLA padding the last share:
    # a device keeps 128 of 511 rather than a quarter, which the same ratio weighs
    assert len(chosen_matmuls(model, t, 667, batch_rows=rows(FEW, LONG - 1))[0]) == 9
    odd = 3 * 2 * 576 * (2 * (576 + 192 + 192 + 576) + 128 + 2 * 2 * (LONG - 1))
    for rate, n in ((1.01 * odd / moved, 0), (0.99 * odd / moved, 9)):
        assert len(chosen_matmuls(model, t, rate, batch_rows=rows(FEW, LONG - 1))[0]) == n


@pytest.mark.slow  # two steps of 511 positions compiled, an evaluation, a layout check: ~10 s
def test_split_by_positions_the_step_computes_a_quarter_of_the_attention_and_trains_as_one_device(
        monkeypatch):
    # 511 positions, which 4 model shards do not divide: XLA pads the last share (128 a device)
    model, batch_rows = smollm2_shaped(layers=1, seq=LONG), rows(FEW, LONG - 1)
    t = trainer(model)
    flops = flops_of(t.compile_train_step(collate(batch_rows)))
    monkeypatch.setattr(steps, "flops_per_link_byte", lambda mesh: float("inf"))
    repeating = trainer(model)
    repeated = flops_of(repeating.compile_train_step(collate(batch_rows)))
    repeated_eval = eval_flops(repeating, batch_rows)
    monkeypatch.undo()
    # per device, on 2 x 4: the projections and the attention on 128 of each data shard's 511
    # positions instead of all of them (forward: one layer, 2 sequences x 511 positions)
    per_token = 2 * 576 * (576 + 192 + 192 + 576) + 2 * 2 * (LONG - 1) * 576
    attention = per_token * (FEW // 2) * (LONG - 1)
    # measured: 9.77e9 -> 2.59e9, 1.06x that share saved (the LM head's too)
    assert repeated - flops >= 3 * attention * (1 - 128 / 511), (repeated, flops)
    # the evaluation, forward only, saves a third of that compute against half the bytes: at
    # 511 positions that does not pay at CPU's rate (563 FLOPs a byte, not 667), and it stays
    assert eval_flops(t, batch_rows) == repeated_eval
    # the loss is one device's (the model run unjitted on the host's first device), and so are
    # the gradients (the layout check)
    batch = collate(batch_rows)
    expected = lm_loss(model)(None, None, model.init(0), batch, False)
    np.testing.assert_allclose(t.eval_loss(batch_rows, FEW // 2), expected, rtol=1e-5)
    report = t.check_layout(batch_rows, FEW // 2)
    assert report.ok and report.compared == "gradients"


def test_positions_are_not_split_in_a_program_holding_an_operation_lowered_with_the_devices(
        monkeypatch):
    """On a GPU the attention is cuDNN's, which refuses operands split by positions ("Sharding on
    sequence dim is not allowed", the compile fails: tests/test_plan_targets.py compiles it);
    XLA spreads the split along the residual stream into it even where the attention's own
    projections are not split. Whole examples are still split: cuDNN takes a split batch."""
    model = smollm2_shaped(seq=LONG)
    t = trainer(model)
    t.compile_train_step(collate(rows(FEW, LONG)))
    from redcoast.models import attention
    monkeypatch.setattr(attention, "xla_attention", vendor_attention)
    chosen, found = chosen_matmuls(model, t, flops_per_byte=0, batch_rows=rows(FEW, LONG))
    assert found.device_bound and found.by_position == set(found.matmuls)
    assert len(found.matmuls) == 9
    assert not chosen and not found.between  # the scores and values are inside the call
    monkeypatch.undo()
    assert len(chosen_matmuls(model, t, 0, batch_rows=rows(FEW, LONG))[0]) == 9
    # 8 sequences, one a device: the examples split, which the call takes
    monkeypatch.setattr(attention, "xla_attention", vendor_attention)
    chosen, found = chosen_matmuls(model, t, flops_per_byte=0, batch_rows=rows(BATCH, LONG))
    assert found.device_bound and not found.by_position and len(chosen) == 9


def test_nothing_changes_on_a_mesh_without_model_shards():
    mesh = Deployer(n_model_shards=1, verbose=False).mesh

    def fn(p, x):
        return jnp.sum(x @ p["w"])
    assert batch_split.split_batches_of_whole_weights(fn, mesh, RewritePlan(), 8, 667) is fn
