"""The Trainer's own compiled step moves Megatron-LM's per-layer bytes between model shards."""

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

from architectures import B, H, T, bert, block_sparse, flax_nnx, gptj_rotary, gqa, moe, plain_jax, scan_stacked
from redcoast import Deployer, Trainer
from redcoast.layout.comms import megatron_ideal, per_layer


def _trainer_step(make_arch, depth, n_model_shards, fuse=True):
    arch = make_arch(n_layers=depth)
    deployer = Deployer(n_model_shards=n_model_shards, verbose=False)
    trainer = Trainer(deployer=deployer, collate_fn=lambda rows: rows, apply_fn=None,
                      loss_fn=lambda rng, state, params, batch, is_training: arch.loss(params, batch),
                      params=arch.params, optimizer=optax.sgd(0.1), fsdp=False,
                      fuse_matmuls=fuse)
    return trainer.compile_train_step(arch.batch), deployer.mesh


@pytest.mark.parametrize("make_arch, n", [(plain_jax, 4), (flax_nnx, 4), (gqa, 2), (bert, 4),
                                          pytest.param(block_sparse, 4, marks=pytest.mark.slow)],
                         ids=["plain_jax", "flax_nnx", "gqa-q-wider-than-kv", "bert-2-row-types",
                              "block-sparse-per-head-gather"])
def test_separate_q_k_v_and_gate_up_reach_megatron_traffic_through_the_trainer(make_arch, n):
    # Separate Q/K/V matmuls: placement alone moves 1.5x Megatron's bytes (test_dataflow);
    # the Trainer fuses sibling matmuls (grouped-query Q with its narrower K/V too), so its step
    # moves exactly the ideal. Block-sparse attention gathers K/V blocks per head: with the heads
    # split through the gather it moves the ideal too (1.5x with K and V replicated).
    mesh = _trainer_step(make_arch, 2, n)[1]
    layer = per_layer(lambda depth: _trainer_step(make_arch, depth, n)[0], mesh)
    ideal = megatron_ideal(B // (jax.device_count() // n), T, H, n)
    assert layer["mp"]["wire_bytes"] / ideal["wire_bytes"] == pytest.approx(1.0)


@pytest.mark.parametrize("make_arch, n, at_most", [(moe, 8, 1.05), (moe, 2, 1.05), (scan_stacked, 4, 0.85),
                                                  (gqa, 8, 1.05), (gqa, 4, 1.05),
                                                  pytest.param(gptj_rotary, 4, 0.75, marks=pytest.mark.slow)],
                         ids=["moe-4-experts-on-8-shards", "moe-experts-split", "scan-remat",
                              "gqa-2-kv-heads-on-8-shards", "gqa-2-kv-heads-on-4-shards",
                              "gptj-parallel-block-stacked-rotary"])
def test_moe_remat_and_replicated_kv_stay_within_megatron_traffic(make_arch, n, at_most):
    # moe: 4 experts on 8 shards split each expert's ffn; summing the expert outputs with their
    # gates before the all-reduce moves one activation, not four (1.75x before the rewrite);
    # on 2 shards (experts split) the gates are pinned whole, so the router is not split (1.086x).
    # scan under jax.checkpoint: Megatron's full recomputation all-reduces 6 times per layer; the
    # recomputed forward here needs only the attention output again (5 of 6).
    # gqa: each KV head kept by the shards of its query heads (a split over groups of shards);
    # projected per query head, the K/V weight gradient is summed within the group only (K/V
    # replicated: 1.107x / 1.125x as written, 1.045x / 1.083x with the weight gradient summed
    # over all shards and gathered).
    # gptj: attention and MLP read one norm and are summed: 2 all-reduces per layer, 0.75x
    # Megatron's 2 + 2 (measured); with Q and K replicated at the rotary's jnp.stack, 1.25x.
    arch = make_arch()
    mesh = _trainer_step(make_arch, 2, n)[1]
    layer = per_layer(lambda depth: _trainer_step(make_arch, depth, n)[0], mesh)
    ideal = megatron_ideal(B // (jax.device_count() // n), T, H, n, recompute=arch.recompute)
    assert layer["mp"]["wire_bytes"] / ideal["wire_bytes"] <= at_most


@pytest.mark.parametrize("fuse, own_step, kv_spec", [(True, False, P(None, "mp:2")), (False, False, P()),
                                                    (True, True, P())],
                         ids=["fused", "as-written", "own-train-step"])
def test_kv_heads_are_kept_by_groups_only_when_the_trainer_rewrites_their_projection(fuse, own_step, kv_spec):
    # as written (fusion off, or a train_step_fn of the user's), XLA would gather K/V's gradient
    # repeated per query head within each group (1.375x Megatron's bytes on 4 shards);
    # replicated K/V move 1.125x there
    from redcoast.layout.steps import make_train_step

    arch = gqa(n_layers=1)
    loss_fn = lambda rng, state, params, batch, is_training: arch.loss(params, batch)  # noqa: E731
    trainer = Trainer(deployer=Deployer(n_model_shards=4, verbose=False), collate_fn=lambda rows: rows,
                      apply_fn=None, loss_fn=loss_fn, params=arch.params, optimizer=optax.sgd(0.1),
                      fsdp=False, fuse_matmuls=fuse,
                      train_step_fn=make_train_step(loss_fn, jax.numpy.float32, 1) if own_step else None)
    trainer.compile_train_step(arch.batch)
    k, = [pl for pl in trainer.plan.compute_placements if pl.path == ("layers", "0", "k")]
    assert k.spec == kv_spec


def test_kv_heads_are_not_kept_by_groups_in_a_step_holding_a_host_callback():
    # K/V kept by groups of shards are placed on a second view of the mesh, which JAX refuses in
    # a program holding a host callback or cuDNN's attention ("mesh should be the same across the
    # entire program": this step failed to compile; the H100 compile with cuDNN's attention is
    # in tests/test_plan_targets.py): they are replicated there, and the loss is one device's
    import numpy as np

    arch = gqa(n_layers=1)

    def loss_fn(rng, state, params, batch, is_training):
        loss = arch.loss(params, batch)  # a metric computed on the host beside it
        seen = jax.pure_callback(np.asarray, jax.ShapeDtypeStruct((), loss.dtype),
                                 jax.lax.stop_gradient(loss), vmap_method="sequential")
        return loss + 0 * seen
    rows = [{key: x[i] for key, x in arch.batch.items()} for i in range(B)]
    trainer = Trainer(deployer=Deployer(n_model_shards=4, verbose=False),
                      collate_fn=lambda rs: {key: np.stack([r[key] for r in rs]) for key in rs[0]},
                      apply_fn=None, loss_fn=loss_fn, params=arch.params, optimizer=optax.sgd(0.1),
                      fsdp=False)
    trainer.compile_train_step(arch.batch)
    k, = [pl for pl in trainer.plan.compute_placements if pl.path == ("layers", "0", "k")]
    assert k.spec == P()
    expected = float(arch.loss(arch.params, arch.batch))
    assert trainer.eval_loss(rows, B // 2) == pytest.approx(expected, rel=1e-5)


def test_a_rule_placing_kv_by_groups_in_a_step_holding_a_host_callback_is_refused_with_the_fix():
    # JAX would refuse it at lowering ("mesh should be the same across the entire program"),
    # naming neither the rule nor what to change
    import numpy as np

    from redcoast.errors import ConfigError
    arch = gqa(n_layers=1)

    def loss_fn(rng, state, params, batch, is_training):
        loss = arch.loss(params, batch)
        seen = jax.pure_callback(np.asarray, jax.ShapeDtypeStruct((), loss.dtype),
                                 jax.lax.stop_gradient(loss), vmap_method="sequential")
        return loss + 0 * seen
    trainer = Trainer(deployer=Deployer(n_model_shards=4, verbose=False), collate_fn=lambda rows: rows,
                      apply_fn=None, loss_fn=loss_fn, params=arch.params, optimizer=optax.sgd(0.1),
                      fsdp=False, params_sharding_rules=[(("layers", "0", "k"), P(None, "mp:2"))])
    with pytest.raises(ConfigError, match=r"layers/0/k as (P|PartitionSpec)\(None, 'mp:2'\)"
                                          r".*Fix: 'mp' or None"):
        trainer.compile_train_step(arch.batch)


def test_fusion_is_on_by_default_and_never_costs_more_than_the_step_as_written():
    # fuse_matmuls=None: on with the built-in step, without comparing; the compiled steps with
    # fusion forced on and off show why: the fused one moves fewer bytes between model shards
    from redcoast.layout.comms import collective_report
    from redcoast.layout.cost_model import estimate

    def trainer(fuse):
        deployer = Deployer(n_model_shards=4, verbose=False)
        arch = plain_jax(n_layers=2)
        t = Trainer(deployer=deployer, collate_fn=lambda rows: rows, apply_fn=None,
                    loss_fn=lambda rng, state, params, batch, is_training: arch.loss(params, batch),
                    params=arch.params, optimizer=optax.sgd(0.1), fsdp=False, fuse_matmuls=fuse)
        return t, t.compile_train_step(arch.batch), deployer.mesh

    chosen, _, _ = trainer(None)
    assert chosen.layout.fuse_matmuls and not chosen.layout.considered  # nothing compiled to compare
    steps = {fuse: trainer(fuse)[1:] for fuse in (False, True)}
    costs = {fuse: estimate(c, m, "cpu").seconds for fuse, (c, m) in steps.items()}
    wire = {fuse: collective_report(c, m).wire_bytes(axis="mp") for fuse, (c, m) in steps.items()}
    assert costs[True] <= costs[False] and wire[True] < wire[False]


def test_a_loss_the_fusion_cannot_run_trains_as_written_with_a_warning(monkeypatch):
    import redcoast.layout.steps

    def broken(fn, plan):
        raise NotImplementedError("an op the rewrite does not know")

    want = _trainer_step(plain_jax, 2, 2)[0]  # compiled with fusion
    monkeypatch.setattr(redcoast.layout.steps, "fuse_sibling_matmuls", broken)
    with pytest.warns(UserWarning, match="could not fuse.*an op the rewrite does not know"):
        got = _trainer_step(plain_jax, 2, 2)[0]
    assert got.as_text() != want.as_text()  # the unfused program, still compiled


def _odd_vocab_lm_step(depth, n_model_shards, vocab=127):
    # GPT-2's own vocabulary (50257) divides no shard count: the plan splits the tied table's
    # hidden axis, and the Trainer keeps that split out of the residual stream
    import numpy as np

    from redcoast.models import Model, gpt2
    model = Model(gpt2.GPT2LMHeadModel, gpt2.Config(vocab_size=vocab, n_positions=T, n_embd=H,
                                                   n_layer=depth, n_head=8))

    def loss_fn(rng, state, params, batch, is_training):
        logits = model.apply(params, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()

    deployer = Deployer(n_model_shards=n_model_shards, verbose=False)
    trainer = Trainer(deployer, lambda rows: rows, model.apply, loss_fn, model.init(0),
                      optax.sgd(0.1), fsdp=False, fuse_matmuls=True)
    ids = np.random.default_rng(0).integers(0, vocab, (B, T + 1)).astype(np.int32)
    step = trainer.compile_train_step({"ids": ids})
    table, = [pl for pl in trainer.plan.placements if "wte" in pl.path]
    assert table.reason.startswith("embedding: hidden axis"), table.reason
    return step, deployer.mesh


@pytest.mark.slow  # two compiled GPT-2 steps on 4 shards: about 30 s of CPU
def test_a_vocabulary_that_does_not_divide_the_shards_costs_no_extra_traffic_per_layer():
    # without the Trainer's pins, XLA spreads the table's hidden split into every layer (1.73x)
    mesh = _odd_vocab_lm_step(1, 4)[1]
    layer = per_layer(lambda depth: _odd_vocab_lm_step(depth, 4)[0], mesh)
    ideal = megatron_ideal(B // (jax.device_count() // 4), T, H, 4)
    assert layer["mp"]["wire_bytes"] / ideal["wire_bytes"] == pytest.approx(1.0)


@pytest.mark.slow
def test_two_towers_each_move_megatrons_bytes():
    """A text and an image tower (CLIP-style, a loss over the batch): each layer of each tower
    moves Megatron's bytes at its own sequence length."""
    from architectures import PATCHES, two_tower
    n = 4
    mesh = _trainer_step(two_tower, 2, n)[1]
    layer = per_layer(lambda depth: _trainer_step(two_tower, depth, n)[0], mesh)
    per_device = B // (jax.device_count() // n)
    ideal = (megatron_ideal(per_device, T, H, n)["wire_bytes"]
             + megatron_ideal(per_device, PATCHES, H, n)["wire_bytes"])
    assert layer["mp"]["wire_bytes"] / ideal == pytest.approx(1.0)


@pytest.mark.slow
def test_a_speech_encoders_transformer_layers_move_megatrons_bytes():
    """wav2vec2-style: the conv feature encoder and the grouped positional conv come once; each
    transformer layer moves Megatron's bytes."""
    from architectures import FRAMES, speech
    n = 4
    mesh = _trainer_step(speech, 2, n)[1]
    layer = per_layer(lambda depth: _trainer_step(speech, depth, n)[0], mesh)
    ideal = megatron_ideal(B // (jax.device_count() // n), FRAMES, H, n)
    assert layer["mp"]["wire_bytes"] / ideal["wire_bytes"] == pytest.approx(1.0)
