"""FSDP (ZeRO-3): parameters and optimizer state also split over 'dp', training unchanged."""

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from redcoast import Deployer, Trainer
from redcoast.sharding.fsdp import fsdp_placements
from redcoast.sharding.rules import Placement, check_spec_fits
from tiny_lm import assert_trees_close

D, F = 256, 1024  # kernels of 1 MiB: at the FSDP threshold; biases below it
OPTIMIZER = optax.sgd(0.1, momentum=0.9)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(F)(x))           # column-parallel: P(None, 'mp')
        x = x + nn.Dense(D)(h)                # row-parallel: P('mp')
        h = nn.gelu(nn.Dense(F)(x))
        return nn.Dense(D)(h)


def make():
    model = MLP()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, D)))["params"]
    rs = np.random.RandomState(0)
    examples = [(rs.randn(D).astype(np.float32), rs.randn(D).astype(np.float32)) for _ in range(64)]
    return model, params, examples


def collate(examples):
    return {"x": np.stack([e[0] for e in examples]), "y": np.stack([e[1] for e in examples])}


def loss(rng, state, params, batch, is_training):
    return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)


def fit(n_model_shards=2, accumulate=1, optimizer=OPTIMIZER, fsdp=True, n_steps=4, per_device=2):
    model, params, examples = make()
    deployer = Deployer(n_model_shards=n_model_shards, verbose=False)
    trainer = Trainer(deployer, collate, model.apply, loss, params, optimizer,
                      accumulate_grad_batches=accumulate, fsdp=fsdp)
    step_size = per_device * deployer.n_data_shards * accumulate
    examples = examples[:step_size * n_steps]
    trainer.fit(examples, per_device, 1, shuffle=False)
    assert trainer.step == n_steps
    return trainer, model, params, examples, step_size


def per_device_bytes(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(tree))


def total_bytes(tree):
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def specs(tree):
    return [x.sharding.spec for x in jax.tree_util.tree_leaves(tree)]


def test_state_memory_per_device_is_about_total_over_device_count():
    trainer = fit()[0]
    state = (trainer.params, trainer.state.opt_state)
    assert per_device_bytes(state) <= 1.15 * total_bytes(state) / 8
    assert trainer.params["Dense_0"]["kernel"].sharding.spec == P("dp", "mp")  # (256, 1024)
    assert trainer.params["Dense_1"]["kernel"].sharding.spec == P("mp", "dp")  # (1024, 256)
    # the printed table counts the 'dp' split too
    assert f"parameter bytes per device: {per_device_bytes(trainer.params):,}" in trainer.plan.table()


@pytest.mark.parametrize("n_model_shards,accumulate", [(2, 1), (2, 2), (1, 1)])
def test_fsdp_training_equals_single_device(n_model_shards, accumulate):
    trainer, model, params, examples, step_size = fit(n_model_shards, accumulate)
    assert any("dp" in str(s) for s in specs(trainer.params))

    state = types.SimpleNamespace(apply_fn=model.apply)
    opt_state = OPTIMIZER.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: loss(None, state, p, batch, True))(params)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for i in range(len(examples) // step_size):
        params, opt_state = step(params, opt_state, collate(examples[i * step_size:(i + 1) * step_size]))
    assert_trees_close(trainer.params, params)


def test_fsdp_false_gives_the_model_parallel_plan():
    on, off = fit()[0], fit(fsdp=False)[0]
    assert all("dp" not in str(s) for s in specs(off.params) + specs(off.state.opt_state))
    # FSDP adds 'dp' to a dimension, or ('dp', 'mp') to one the plan replicates
    strip = lambda s: P(*[None if a == "dp" or (isinstance(a, tuple) and "dp" in a) else a for a in s])
    from redcoast.sharding.rules import normalize_spec
    assert [normalize_spec(strip(s)) for s in specs(on.params)] == specs(off.params)
    # the deployer's default plan and rules stay the paper's mp-only ones
    plan = off.deployer.get_sharding_plan(off.params)
    assert all("dp" not in str(spec) for _, spec in off.deployer.get_sharding_rules(off.params))
    assert all("dp" not in str(pl.spec) for pl in plan.placements)


def test_fsdp_true_splits_every_tensor_a_dimension_of_allows():
    # asked for (fsdp=True), FSDP splits every tensor, however small, that has a dimension the
    # data shards divide and no 'dp' yet; which are worth it is fsdp_cost.py's (fsdp=None)
    trainer = fit()[0]
    n_data = trainer.mesh.shape["dp"]
    for pl in trainer.plan.placements:
        if "dp" not in str(pl.spec):  # only where no free dimension divides
            assert not any(n % n_data == 0 and (d >= len(pl.spec) or pl.spec[d] is None)
                           for d, n in enumerate(pl.shape)), pl
            assert "no unsplit dimension" in pl.reason, pl


def test_fsdp_placements_add_dp_to_one_free_dimension():
    f32 = np.float32
    pls = [Placement(("a",), (128, 512), f32, P(None, "mp"), "col"),
           Placement(("b",), (512, 256), f32, P("mp"), "row"),
           Placement(("c",), (256, 512), f32, P(), "rep"),
           Placement(("d",), (256, 512), f32, P("dp"), "user rule"),
           Placement(("e",), (6, 512 * 32), f32, P(None, "mp"), "no free dim divides"),
           Placement(("f",), (512,), f32, P("mp"), "small")]
    out = {pl.path[0]: pl for pl in fsdp_placements(pls, 4, keep={("c",)})}
    assert out["a"].spec == P("dp", "mp")
    assert out["b"].spec == P("mp", "dp")
    assert out["c"].spec == P() and "by cost" in out["c"].reason  # kept, as fsdp_cost.py chose
    assert fsdp_placements(pls, 4)[2].spec == P(None, "dp")  # the larger dimension
    assert out["d"] == pls[3]  # a user rule naming 'dp' is kept as written
    assert out["e"].spec == P(None, "mp") and "no unsplit dimension" in out["e"].reason
    assert out["f"].spec == P("mp") and "no unsplit dimension" in out["f"].reason
    assert fsdp_placements(pls, 1) == pls
    # with 2 model shards, a tensor the plan replicates is split over both axes where it can be
    both = {pl.path[0]: pl for pl in fsdp_placements(pls, 4, n_model_shards=2)}
    assert both["c"].spec == P(None, ("dp", "mp")) and "dp and mp" in both["c"].reason
    assert both["a"].spec == P("dp", "mp") and both["d"] == pls[3]
    odd = Placement(("g",), (12, 4 * 1024), f32, P(), "rep")  # 12 % 8: only dim 1 divides
    assert fsdp_placements([odd], 4, n_model_shards=2)[0].spec == P(None, ("dp", "mp"))
    odd = Placement(("h",), (12, 4 * 1021), f32, P(), "rep")  # no dim divides 8: dp alone, larger dim
    assert fsdp_placements([odd], 4, n_model_shards=2)[0].spec == P(None, "dp")


def test_tensors_the_plan_replicates_are_split_over_all_devices_and_train_the_same():
    # a fused (512, 1536) QKV written as one matrix: its Q, K, V are sliced out and its whole
    # output is read too (so it cannot be stored permuted, sharding/permuted.py), so the plan
    # replicates it over the model shards; FSDP then splits it over dp and mp together
    rs = np.random.RandomState(0)
    params = {"qkv": (rs.randn(512, 1536) * 0.05).astype(np.float32),
              "out": (rs.randn(512, 512) * 0.05).astype(np.float32)}
    examples = [rs.randn(512).astype(np.float32) for _ in range(32)]

    def qkv_loss(rng, state, p, batch, is_training):
        x = batch["x"]
        qkv = x @ p["qkv"]
        q, k, v = jnp.split(qkv, 3, axis=-1)
        return jnp.mean(((jax.nn.sigmoid(q * k) * v) @ p["out"] - x) ** 2) + 1e-3 * jnp.mean(qkv ** 2)

    collate_x = lambda rows: {"x": np.stack(rows)}  # noqa: E731
    # fsdp=True: what FSDP does with such a tensor (left None, FSDP by cost may keep it
    # replicated, as it does for this small model on CPU devices)
    trainer = Trainer(Deployer(n_model_shards=2, verbose=False), collate_x, None, qkv_loss, params,
                      OPTIMIZER, fsdp=True)
    trainer.fit(examples, 2, 1, shuffle=False)  # 4 steps of 8
    assert trainer.params["qkv"].sharding.spec == P(None, ("dp", "mp"))
    assert trainer.params["qkv"].addressable_shards[0].data.shape == (512, 1536 // 8)

    step = jax.jit(lambda p, o, x: _sgd_step(qkv_loss, p, o, x))
    want, opt_state = params, OPTIMIZER.init(params)
    for i in range(4):
        want, opt_state = step(want, opt_state, collate_x(examples[8 * i:8 * i + 8]))
    assert_trees_close(trainer.params, want)


def _sgd_step(loss_fn, params, opt_state, batch):
    grads = jax.grad(lambda p: loss_fn(None, None, p, batch, True))(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@pytest.mark.parametrize("name,tx", [("adafactor", optax.adafactor(1e-3, min_dim_size_to_factor=8)),
                                     ("adamw", optax.adamw(1e-3))])
def test_optimizer_state_specs_divide_their_arrays(name, tx):
    trainer = fit(optimizer=tx, n_steps=2)[0]
    sizes = dict(trainer.deployer.mesh.shape)
    leaves = jax.tree_util.tree_leaves_with_path(trainer.state.opt_state)
    for path, leaf in leaves:
        check_spec_fits(leaf.sharding.spec, leaf.shape, sizes, jax.tree_util.keystr(path))
        assert np.all(np.isfinite(np.asarray(leaf)))
    dp_leaves = [leaf for _, leaf in leaves if "dp" in str(leaf.sharding.spec)]
    assert dp_leaves  # the large statistics (adafactor's factored rows, adam's moments) are split


class EmbedLM(nn.Module):
    """Embedding (1 MiB, above the FSDP threshold; its vocabulary split over 'mp', its hidden axis
    over 'dp'), one MLP block, a tied head: the shape that made XLA reshard activations."""
    vocab: int = 1024

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(self.vocab, D)
        x = embed(ids)
        h = nn.LayerNorm()(x)
        x = x + nn.Dense(D)(nn.gelu(nn.Dense(F // 4)(h)))
        return embed.attend(nn.LayerNorm()(x))


def test_fsdp_adds_only_weight_gathers_to_the_compiled_step():
    # the FSDP step's collectives are the tensor-parallel step's plus, over 'dp', one all-gather
    # of each FSDP-split weight (its full size) and the gradient sum: no activation reshards.
    # 256 rows a step: every weight weighs at most the rows it reads (else the step leaves it to
    # the partitioner, which may move the rows instead: sharding/stationary_weights.py)
    model = EmbedLM()
    ids = np.random.RandomState(0).randint(0, 1024, (16, 16)).astype(np.int32)
    params = model.init(jax.random.PRNGKey(0), ids[:1])["params"]

    def lm_loss(rng, state, p, batch, is_training):
        logits = state.apply_fn({"params": p}, batch["ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"]).mean()

    from redcoast.layout.comms import collective_report
    reports = {}
    for fsdp in (False, True):
        deployer = Deployer(n_model_shards=2, verbose=False)
        trainer = Trainer(deployer, lambda rows: rows, model.apply, lm_loss, params,
                          optax.adamw(1e-3), fsdp=fsdp)
        compiled = trainer.compile_train_step({"ids": ids})
        reports[fsdp] = collective_report(compiled, deployer.mesh)
        if fsdp:
            split = [pl for pl in trainer.plan.placements if "dp" in str(pl.spec)]
    assert ("Embed_0", "embedding") in [pl.path for pl in split]
    plain, fsdp = reports[False], reports[True]
    assert fsdp.count("all-to-all") == 0
    assert fsdp.count("collective-permute") == plain.count("collective-permute")
    assert fsdp.by_kind("mp") == plain.by_kind("mp")
    # one all-gather of each split weight, to where the step uses it (the embedding's 'mp' half)
    assert fsdp.count("all-gather") - plain.count("all-gather") == len(split)
    # the gradients' sum over 'dp': one all-reduce (or reduce-scatters) of the same bytes
    assert (fsdp.bytes("all-reduce", "dp") + fsdp.bytes("reduce-scatter", "dp")
            <= plain.bytes("all-reduce", "dp"))


def test_layout_choice_takes_the_cheapest_that_fits_and_prefers_memory_on_a_tie():
    from redcoast.layout.cost_model import Estimate, choose

    def est(mib, seconds):
        return Estimate(mib * 2**20, 0.0, 0.0, 0, 0.0, seconds)

    assert choose([est(10, 1.0), est(20, 0.5)], budget_bytes=2**30)[0] == 1
    assert choose([est(10, 1.0), est(20, 0.5)], budget_bytes=15 * 2**20)[0] == 0  # 20 MiB over
    assert choose([est(10, 1.001), est(20, 1.0)], budget_bytes=2**30)[0] == 0  # a tie: less memory
    i, why = choose([est(30, 1.0), est(20, 2.0)], budget_bytes=2**20)
    assert i == 1 and "none fits" in why


def test_kv_kept_by_groups_are_stored_split_over_every_model_shard():
    # 4 KV heads of width 32 on 8 shards: used by groups of 2 shards ('mp:4'), stored 1/8 per
    # shard (the hand-written Megatron split), unless the width does not divide or a user said so
    from redcoast.sharding.fsdp import ungrouped_storage
    kv = Placement(("k", "kernel"), (256, 128), np.float32, P(None, "mp:4"), "traced")
    narrow = Placement(("k2", "kernel"), (256, 4), np.float32, P(None, "mp:4"), "traced")
    user = Placement(("k3", "kernel"), (256, 128), np.float32, P(None, "mp:4"), "user rule")
    got = ungrouped_storage([kv, narrow, user], n_model_shards=8)
    assert [pl.spec for pl in got] == [P(None, "mp"), P(None, "mp:4"), P(None, "mp:4")]
    assert ungrouped_storage([kv], n_model_shards=1)[0].spec == P(None, "mp:4")


# -- FSDP at long context (issue 46): what a layer keeps for the backward pass ----------------

LONG_CONTEXT_LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=1024)


def _long_context_temporaries(seq_len=512, **overrides):
    """The compiler's temporaries (bytes a device) of a small Llama's FSDP step over 8
    devices at ``seq_len`` tokens, one row a device: at this length attention's scores dwarf
    the weights, so what the step keeps of each layer shows."""
    from redcoast.models import model_from_config
    model, abstract = model_from_config(LONG_CONTEXT_LLAMA, config_overrides=overrides or None)

    def lm_loss(rng, state, params, batch, is_training):
        logits = model.apply(params, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()

    deployer = Deployer(n_model_shards=1, verbose=False)
    trainer = Trainer(deployer, lambda rows: rows, model.apply, lm_loss, abstract,
                      optax.adamw(1e-3), fsdp=True)
    ids = jax.ShapeDtypeStruct((deployer.n_data_shards, seq_len + 1), jnp.int32)
    return trainer.compile_train_step({"ids": ids}).memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # two compilations of an 8-device step: 15 s each on 2 busy cores
def test_remat_keeps_one_layer_of_attention_on_the_cpu_stand_in():
    # XLA:CPU (redcoast plan's stand-in) merged the recomputed forward pass back into the
    # forward pass (compiler_options.py): every layer's scores were kept, remat or not
    kept = _long_context_temporaries()
    rematerialised = _long_context_temporaries(remat=True)
    scores = 4 * 512 * 512 * 4  # one layer's attention probabilities, float32, one row
    assert kept > 4 * scores  # every layer's scores at least once
    assert rematerialised < 0.5 * kept


def _checkpointed_constraints(jaxpr):
    """How many sharding constraints run inside rematerialised bodies of ``jaxpr``."""
    count = 0
    for eqn in jaxpr.eqns:
        subs = [v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
        for sub in subs:
            sub = sub.jaxpr if hasattr(sub, "jaxpr") else sub
            if eqn.primitive.name in ("checkpoint", "remat", "remat2"):
                count += sum(e.primitive.name == "sharding_constraint" for e in sub.eqns)
            count += _checkpointed_constraints(sub)
    return count


@pytest.mark.slow  # two FSDP steps on 8 devices: 70 s on 2 busy cores
@pytest.mark.parametrize("n_model_shards", [1, 8])
def test_rematerialised_layers_gather_their_weights_inside_and_train_the_same(n_model_shards):
    # FSDP gathers a rematerialised layer's weights inside its remat, so that the backward pass
    # gathers them again instead of keeping every layer gathered (sharding/remat_weights.py);
    # over 8 model shards the 4 K/V heads are split over groups of the shards ('mp:4'), a spec
    # only grouped_axes' mesh names (the constraint failed on it: "mp:4 ... not found in mesh")
    from redcoast.models import Model
    from redcoast.models.llama import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, remat=True)
    model = Model(LlamaForCausalLM, config)
    params = model.init(0)
    rows = np.random.RandomState(0).randint(0, 64, (16, 9)).astype(np.int32)

    def lm_loss(rng, state, p, batch, is_training):
        logits = model.apply(p, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()

    deployer = Deployer(n_model_shards=n_model_shards, verbose=False)
    trainer = Trainer(deployer, lambda batch: {"ids": np.stack(batch)}, model.apply, lm_loss,
                      params, optax.sgd(0.5), fsdp=True)
    per_step = 8 // n_model_shards
    trainer.fit(list(rows[:2 * per_step]), per_device_batch_size=1, n_epochs=1, shuffle=False)
    assert trainer.step == 2
    if n_model_shards == 1:
        step = trainer.layout.train_step.__wrapped__  # the step as traced, not compiled
        traced = jax.make_jaxpr(step)(trainer.state, {"ids": rows[:8]}, jax.random.PRNGKey(0))
        assert _checkpointed_constraints(traced.jaxpr) >= 2 * 9  # both layers' nine weights

    state = types.SimpleNamespace(apply_fn=model.apply)
    for i in range(2):
        batch = {"ids": rows[per_step * i:per_step * (i + 1)]}
        grads = jax.grad(lambda p: lm_loss(None, state, p, batch, True))(params)
        params = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads)
    assert_trees_close(trainer.params, params)
