"""The plan's own figure for Megatron's bytes between model shards, and the Trainer's warning when
its compiled step moves more (issue 49, item 3)."""

import jax
import numpy as np
import optax
import pytest

from architectures import B, H, T, moe, plain_jax, scan_stacked
from redcoast import Deployer, Trainer
from redcoast.layout.comms import megatron_ideal
from redcoast.layout.megatron_bytes import StepBytes, bytes_shortfall
from redcoast.sharding.dataflow import dataflow_placements
from redcoast.sharding.plan import ShardingPlan

N = 4


def _plan(make, depth, n=N):
    arch = make(n_layers=depth)
    placements = dataflow_placements(arch.loss, arch.params, arch.batch, n_model_shards=n)
    mesh = jax.make_mesh((jax.device_count() // n, n), ("dp", "mp"))
    return ShardingPlan(arch.params, mesh, base_placements=placements), arch


@pytest.mark.parametrize("make", [plain_jax, moe, scan_stacked], ids=["dense", "moe", "scan-remat"])
def test_the_plan_counts_megatrons_all_reduces_per_layer(make):
    # two all-reduces of the [batch, seq, hidden] activation forward per layer (the attention's
    # and the MLP's row-parallel outputs; an MoE's combine), the same backward; a layer under
    # jax.checkpoint runs its forward again: 6 instead of 4 (Megatron's full recomputation)
    (two, arch), (four, _) = _plan(make, 2), _plan(make, 4)
    per_layer = (four.megatron_wire_elements() - two.megatron_wire_elements()) / 2
    ideal = megatron_ideal(B // (jax.device_count() // N), T, H, N, itemsize=1,
                           recompute=arch.recompute)
    assert per_layer == pytest.approx(ideal["wire_bytes"])  # in values: one byte each


def test_rules_that_change_the_plan_leave_its_megatron_bytes_unknown():
    arch = plain_jax(n_layers=2)
    placements = dataflow_placements(arch.loss, arch.params, arch.batch, n_model_shards=N)
    mesh = jax.make_mesh((jax.device_count() // N, N), ("dp", "mp"))
    kept = ShardingPlan(arch.params, mesh, base_placements=placements)
    assert kept.megatron_wire_elements() is not None
    changed = ShardingPlan(arch.params, mesh, base_placements=placements,
                           user_rules=[(("blocks", "0", "a7"), jax.sharding.PartitionSpec())])
    assert changed.megatron_wire_elements() is None
    assert "under Megatron's split of this plan" in kept.table()


def _fit_one_step(make, n, capsys, fuse_matmuls=None):
    arch = make(n_layers=2)
    collate = lambda rows: {k: np.stack([r[k] for r in rows]) for k in rows[0]}  # noqa: E731
    trainer = Trainer(Deployer(n_model_shards=n, verbose=False), collate, None,
                      lambda rng, state, params, batch, is_training: arch.loss(params, batch),
                      arch.params, optax.sgd(0.1), fuse_matmuls=fuse_matmuls)
    rows = [{k: v[i] for k, v in arch.batch.items()} for i in range(B)]
    trainer.train(rows, B // trainer.layout.n_data_shards, shuffle=False)
    return trainer, capsys.readouterr().err


@pytest.mark.parametrize("make", [plain_jax, moe, scan_stacked], ids=["dense", "moe", "scan-remat"])
def test_the_trainer_measures_its_step_against_megatron_and_stays_quiet_on_its_families(make,
                                                                                        capsys):
    trainer, said = _fit_one_step(make, N, capsys)
    measured = trainer._step_bytes
    assert measured is not None and measured.megatron > 0
    assert 0.8 <= measured.ratio <= 1.1, measured
    assert "bytes between the" not in said


def test_a_step_over_megatrons_bytes_is_said_with_the_weights_kept_whole_and_the_fix():
    plan, _ = _plan(plain_jax, 2)
    ideal = 4 * plan.megatron_wire_elements()
    assert bytes_shortfall(StepBytes(1.2 * ideal, ideal), plan) is None
    said = bytes_shortfall(StepBytes(2 * ideal, ideal, (("all-gather of dot_general", ideal),)),
                           plan)
    assert said.startswith("the compiled step moves 2.00x the bytes between the 4 model shards")
    assert "all-gather of dot_general" in said and "n_model_shards=1" in said


def test_a_step_without_the_fusion_rewrites_is_said_to_move_more_and_why(capsys):
    # separate Q/K/V matmuls, as written: each sums its input's gradient over the shards
    # (1.5x Megatron's bytes per layer, test_trainer_comms.py); fusion off, as a user's own
    # train_step_fn has it by default
    trainer, said = _fit_one_step(plain_jax, N, capsys, fuse_matmuls=False)
    assert trainer._step_bytes.ratio > 1.25
    assert "the compiled step moves" in said and "fuse_matmuls=True" in said, said
    assert said.count("the compiled step moves") == 1


def _family_trainer(family, module, overrides, inputs):
    import dataclasses
    import jax.numpy as jnp
    from redcoast.models import Model
    model = Model(module, dataclasses.replace(family.Config(), scan_layers=True, **overrides))
    ids = np.random.default_rng(0).integers(0, 256, (B, 16)).astype(np.int32)

    def loss(rng, state, params, batch, is_training):
        args = (batch["ids"], jnp.ones_like(batch["ids"])) * (inputs // 2)  # ids, mask (twice)
        return sum(jnp.mean(jnp.square(o.astype(jnp.float32)))
                   for o in jax.tree_util.tree_leaves(model.apply(params, *args)))
    trainer = Trainer(Deployer(n_model_shards=N, verbose=False),
                      lambda rows: {"ids": np.stack([r["ids"] for r in rows])}, model.apply, loss,
                      model.init(0), optax.adamw(1e-3))
    trainer.train([{"ids": row} for row in ids], B // trainer.layout.n_data_shards, shuffle=False)
    return trainer


@pytest.mark.parametrize("name", ["llama", "bart", "bert"])
def test_the_projects_families_move_megatrons_bytes_and_say_nothing(name, capsys):
    # scanned layers (the bodies counted per iteration), an encoder-decoder's cross-attention;
    # measured on all seven families, scanned and not, on 2 and 4 shards: 0.80-1.04x
    from redcoast.models import bart, bert, llama
    small = dict(vocab_size=256, max_position_embeddings=64)
    families = {
        "llama": (llama, llama.LlamaForCausalLM, dict(small, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, head_dim=8), 2),
        "bart": (bart, bart.BartForConditionalGeneration, dict(small, d_model=64, encoder_layers=2,
                 encoder_ffn_dim=128, encoder_attention_heads=8, decoder_layers=2,
                 decoder_ffn_dim=128, decoder_attention_heads=8), 4),
        "bert": (bert, bert.BertModel, dict(small, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=8, intermediate_size=128), 2)}
    trainer = _family_trainer(*families[name])
    assert 0.8 <= trainer._step_bytes.ratio <= 1.05
    assert "WARNING" not in capsys.readouterr().err
