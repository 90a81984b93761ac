"""LoRA adapters (redcoast/lora.py): the base model's outputs at B = 0, the merge against numpy,
training that moves only the adapters (split over devices as on one), the optimizer state and
step FLOPs against full fine-tuning, and export merged (read by transformers) or alone."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from redcoast import ConfigError, Deployer, LoRA, Trainer, load_adapters, save_adapters
from redcoast.lora import count
from redcoast.models import Model, llama

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
SEQ = 12


def _model(seed=0):
    """A tiny Llama with random weights of order 0.1 (norm scales near 1), so that logits are
    of order one; drawn in numpy (no compilation)."""
    model = Model(llama.MODULES["LlamaForCausalLM"], llama.Config(**TINY))
    rs = np.random.RandomState(seed)

    def draw(path, leaf):
        noise = rs.normal(0, 0.1 if "norm" in jax.tree_util.keystr(path) else 0.15, leaf.shape)
        return (noise + ("norm" in jax.tree_util.keystr(path))).astype(leaf.dtype)
    return model, jax.tree_util.tree_map_with_path(draw, model.abstract_params())


def _examples(n, seed=0):
    """Sequences that count up from a random start: learnable from one token to the next."""
    starts = np.random.RandomState(seed).randint(0, TINY["vocab_size"], n)
    return [{"ids": (s + np.arange(SEQ)) % TINY["vocab_size"]} for s in starts]


def _collate(examples):
    return {"ids": np.stack([e["ids"] for e in examples]).astype(np.int32)}


def _lm_loss(apply_fn, params, ids):
    logits = apply_fn(params, ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def _random_adapters(lora, params, seed=1, std=0.2):
    """Adapters with B drawn at random too, so that they change the model."""
    rs = np.random.RandomState(seed)
    return jax.tree_util.tree_map(
        lambda x: (std * rs.standard_normal(x.shape)).astype(x.dtype),
        jax.eval_shape(lora.init, params))


def test_default_targets_are_attention_q_and_v_and_zero_b_gives_the_base_outputs():
    model, base = _model()
    lora = LoRA(rank=4, alpha=8)
    adapters = lora.init(base)
    layer = adapters["layers"]["0"]["self_attn"]
    assert sorted(layer) == ["q_proj", "v_proj"] and sorted(adapters["layers"]) == ["0", "1"]
    assert layer["v_proj"]["kernel"]["lora_a"].shape == (32, 4)
    assert layer["v_proj"]["kernel"]["lora_b"].shape == (4, 16)  # 2 KV heads x 8
    assert not np.any(np.asarray(layer["q_proj"]["kernel"]["lora_b"]))
    ids = jnp.asarray(np.stack([e["ids"] for e in _examples(3)]))
    apply = jax.jit(model.apply)
    np.testing.assert_array_equal(apply(lora.merge(base, adapters), ids), apply(base, ids))


def test_merge_adds_scaled_low_rank_product_on_kernels_with_extra_axes():
    """A GPT-2-like fused kernel [in, 3, hidden] and layers stacked on a leading axis."""
    rs = np.random.RandomState(0)
    params = {"h": {"c_attn": {"kernel": rs.randn(5, 3, 4).astype(np.float32),
                               "bias": rs.randn(3, 4).astype(np.float32)}},
              "stacked": {"q": {"kernel": rs.randn(2, 5, 6).astype(np.float32)}}}
    fused = LoRA(rank=2, alpha=3.0, targets="c_attn/kernel")
    a = _random_adapters(fused, params)
    pair = a["h"]["c_attn"]["kernel"]
    want = params["h"]["c_attn"]["kernel"] + 1.5 * np.einsum(
        "ir,rcd->icd", np.asarray(pair["lora_a"]), np.asarray(pair["lora_b"]))
    merged = fused.merge(params, a)
    np.testing.assert_allclose(merged["h"]["c_attn"]["kernel"], want, rtol=1e-6, atol=1e-6)
    assert merged["h"]["c_attn"]["bias"] is params["h"]["c_attn"]["bias"]
    assert merged["stacked"]["q"]["kernel"] is params["stacked"]["q"]["kernel"]

    stacked = LoRA(rank=2, alpha=2.0, targets=lambda path, leaf: path.startswith("stacked"),
                   stack_dims=1)
    a = _random_adapters(stacked, params)
    pair = a["stacked"]["q"]["kernel"]
    assert pair["lora_a"].shape == (2, 5, 2) and pair["lora_b"].shape == (2, 2, 6)
    want = params["stacked"]["q"]["kernel"] + np.einsum(
        "lir,lro->lio", np.asarray(pair["lora_a"]), np.asarray(pair["lora_b"]))
    np.testing.assert_allclose(stacked.merge(params, a)["stacked"]["q"]["kernel"], want,
                               rtol=1e-6, atol=1e-6)



def test_a_merge_outside_a_jitted_function_keeps_each_kernels_sharding():
    """As after FSDP training: adapters split over all 8 devices, kernels over the model axis;
    the merge (one program outside the step) equals the merge inside one, placed as the base."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    _, base = _model()
    lora = LoRA(rank=4, alpha=8)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "mp"))
    placed = jax.tree_util.tree_map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "mp") if x.ndim == 2 else P())),
        base)
    adapters = jax.tree_util.tree_map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P(("dp", "mp")) if x.shape[-1] == 4
                                                  else P(None, ("dp", "mp")))),
        _random_adapters(lora, base))
    merged = lora.merge(placed, adapters)
    inside = jax.jit(lora.merge)(placed, adapters)
    for path in [("layers", "0", "self_attn", "q_proj", "kernel"),
                 ("layers", "1", "self_attn", "v_proj", "kernel")]:
        got, want, kernel = (_at(t, path) for t in (merged, inside, placed))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert got.sharding == kernel.sharding, path
    assert _at(merged, ("layers", "0", "mlp", "up_proj", "kernel")) is _at(
        placed, ("layers", "0", "mlp", "up_proj", "kernel"))


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree

def test_targets_that_match_nothing_are_an_error():
    _, base = _model()
    with pytest.raises(ConfigError, match="match no parameter"):
        LoRA(targets="attention/query_kernel").init(base)


def _lora_trainer(n_model_shards, optimizer, base, lora):
    def loss_fn(rng, state, params, batch, is_training):
        return _lm_loss(state.apply_fn, lora.merge(state.frozen_params, params), batch["ids"])

    model, _ = _model()
    deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, verbose=False)
    # layout fixed: the tests need not compile the candidate layouts
    return Trainer(deployer, _collate, model.apply, loss_fn, lora.init(base), optimizer,
                   frozen_params=base, fsdp=False, fuse_matmuls=False)


def test_training_moves_only_the_adapters_and_the_loss_falls():
    model, base = _model()
    kept = jax.tree_util.tree_map(np.array, base)
    lora = LoRA(rank=4, alpha=8, targets=r"kernel$")  # every matmul, the LM head too
    trainer = _lora_trainer(2, optax.adam(3e-2), base, lora)
    examples = _examples(32)
    before = trainer.eval_loss(examples, 4)
    trainer.fit(examples, per_device_batch_size=1, n_epochs=4)
    after = trainer.eval_loss(examples, 4)
    assert after < 0.7 * before, (before, after)
    # the base bitwise as it was; the optimizer state has the adapters' leaves and no other
    jax.tree_util.tree_map(np.testing.assert_array_equal, trainer.frozen_params, kept)
    jax.tree_util.tree_map(np.testing.assert_array_equal, base, kept)
    adam = trainer.state.opt_state[0]
    assert jax.tree_util.tree_structure(adam.mu) == jax.tree_util.tree_structure(trainer.params)
    adapter_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(trainer.params))
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(trainer.state.opt_state))
    assert state_bytes == 2 * adapter_bytes + 4  # Adam's two moments of the adapters + a count
    assert not np.allclose(trainer.params["layers"]["0"]["self_attn"]["q_proj"]["kernel"]["lora_b"], 0)


def test_optimizer_state_of_lora_on_smollm2_135m_is_under_5_percent_of_full():
    """Shapes only (nothing of the base allocated): SmolLM2-135M's config, rank 8 on q and v."""
    config = llama.Config(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          tie_word_embeddings=True)
    base = Model(llama.MODULES["LlamaForCausalLM"], config).abstract_params()
    adapters = jax.eval_shape(LoRA(rank=8, alpha=16).init, base)
    nbytes = lambda tree: sum(np.dtype(x.dtype).itemsize * x.size  # noqa: E731
                              for x in jax.tree_util.tree_leaves(tree))
    optimizer = optax.adamw(1e-4)
    lora_state, full_state = (nbytes(jax.eval_shape(optimizer.init, p)) for p in (adapters, base))
    assert count(adapters) == 30 * 8 * (576 + 576 + 576 + 192)
    assert lora_state < 0.05 * full_state, (lora_state, full_state)


def test_sharded_lora_training_equals_single_device():
    """2 model shards x 4 data shards against a plain jax loop on one device (SGD with momentum,
    linear in the gradients, so only rounding differs)."""
    _, base = _model()
    lora = LoRA(rank=4, alpha=8)
    optimizer = optax.sgd(0.5, momentum=0.9)
    examples = _examples(32)
    model, _ = _model()
    # the base placed by the plan traced from the forward pass (Megatron's splits), as
    # from_pretrained(folder, deployer) places it; the Trainer keeps that placement
    ids = jax.ShapeDtypeStruct((2, SEQ - 1), jnp.int32)
    plan = Deployer(n_model_shards=2, verbose=False).get_sharding_plan(
        base, traced_fn=model.apply, example_args=(ids,))
    placed = jax.device_put(base, plan.param_shardings())
    trainer = _lora_trainer(2, optimizer, placed, lora)
    attention = trainer.frozen_params["layers"]["0"]["self_attn"]
    assert attention["q_proj"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "mp")
    assert attention["o_proj"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("mp")
    trainer.fit(examples, per_device_batch_size=4, n_epochs=2, shuffle=False)  # 16 per update
    assert trainer.step == 4

    device = jax.devices()[0]
    adapters, frozen = jax.device_put((lora.init(base), base), device)
    opt_state = optimizer.init(adapters)

    @jax.jit
    def step(adapters, opt_state, frozen, ids):
        grads = jax.grad(lambda a: _lm_loss(model.apply, lora.merge(frozen, a), ids))(adapters)
        updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state

    for _ in range(2):
        for i in range(2):
            ids = jnp.asarray(_collate(examples[i * 16:(i + 1) * 16])["ids"])
            adapters, opt_state = step(adapters, opt_state, frozen, ids)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4),
                           trainer.params, adapters)
    moved = adapters["layers"]["1"]["self_attn"]["v_proj"]["kernel"]["lora_b"]
    assert float(np.abs(np.asarray(moved)).max()) > 1e-3  # the comparison is not of zeros


def test_compiled_lora_step_does_fewer_flops_than_full_fine_tuning():
    model, base = _model()
    lora = LoRA(rank=4, alpha=8)
    batch = _collate(_examples(8))
    lora_flops = _lora_trainer(1, optax.adam(1e-3), base, lora).compile_train_step(batch) \
        .cost_analysis()["flops"]

    def full_loss(rng, state, params, batch, is_training):
        return _lm_loss(state.apply_fn, params, batch["ids"])

    full = Trainer(Deployer(jax_seed=0, n_model_shards=1, verbose=False), _collate, model.apply,
                   full_loss, base, optax.adam(1e-3))
    full_flops = full.compile_train_step(batch).cost_analysis()["flops"]
    assert 0 < lora_flops < full_flops, (lora_flops, full_flops)


def test_adapters_saved_alone_load_back(tmp_path):
    model, base = _model()
    lora = LoRA(rank=3, alpha=6.0)
    adapters = _random_adapters(lora, base)
    save_adapters(lora, adapters, str(tmp_path / "a"))
    config = json.loads((tmp_path / "a" / "lora_config.json").read_text())
    assert config["rank"] == 3 and config["alpha"] == 6.0 and len(config["kernels"]) == 4
    lora2, adapters2 = load_adapters(str(tmp_path / "a"))
    assert (lora2.rank, lora2.alpha, lora2.scale) == (3, 6.0, 2.0)
    jax.tree_util.tree_map(np.testing.assert_array_equal, adapters2, adapters)
    ids = jnp.asarray(_collate(_examples(2))["ids"])
    apply = jax.jit(model.apply)
    np.testing.assert_array_equal(apply(lora2.merge(base, adapters2), ids),
                                  apply(lora.merge(base, adapters), ids))
    with pytest.raises(ConfigError, match="lora_config.json"):
        load_adapters(str(tmp_path))


def test_merged_export_is_read_by_transformers_with_the_adapted_logits(tmp_path):
    torch = pytest.importorskip("torch", reason="test-only reference: pip install torch==2.13.0")
    transformers = pytest.importorskip("transformers")
    from hf_reference import randomize
    from redcoast.models import from_pretrained, save_pretrained

    randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))).save_pretrained(
        str(tmp_path / "base"))
    model, base = from_pretrained(str(tmp_path / "base"))
    lora = LoRA(rank=4, alpha=8)
    adapters = _random_adapters(lora, base)
    merged = lora.merge(base, adapters)
    save_pretrained(model, merged, str(tmp_path / "merged"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    ids = np.stack([e["ids"] for e in _examples(3, seed=5)])
    with torch.no_grad():
        theirs = reloaded(torch.tensor(ids)).logits.float().numpy()
    ours = np.asarray(jax.jit(model.apply)(merged, jnp.asarray(ids)))
    plain = np.asarray(jax.jit(model.apply)(base, jnp.asarray(ids)))
    assert np.abs(ours - plain).max() > 0.1  # the adapters do change the logits
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


@pytest.mark.slow  # two runs with checkpoints: ~9 s on the loaded 2-core box
def test_checkpoints_hold_the_adapters_and_resume_with_the_base_given_again(tmp_path):
    _, base = _model()
    lora = LoRA(rank=4, alpha=8)
    examples = _examples(32)

    def run(n_epochs):
        def loss_fn(rng, state, params, batch, is_training):
            return _lm_loss(state.apply_fn, lora.merge(state.frozen_params, params), batch["ids"])
        model, _ = _model()
        deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False, workdir=str(tmp_path))
        trainer = Trainer(deployer, _collate, model.apply, loss_fn, lora.init(base),
                          optax.adam(1e-2), frozen_params=base, fsdp=False, fuse_matmuls=False)
        trainer.fit(examples, per_device_batch_size=2, n_epochs=n_epochs, save_every_k_epochs=1)
        return trainer

    first = run(1)
    saved = sorted(p.name for p in (tmp_path / "checkpoints" / "steps").iterdir())
    resumed = run(1)  # resumes at the end of epoch 1: nothing left to train
    assert resumed.step == first.step == 4 and saved  # 32 examples, 8 per update
    jax.tree_util.tree_map(np.testing.assert_array_equal, resumed.params, first.params)
    assert not np.allclose(first.params["layers"]["0"]["self_attn"]["q_proj"]["kernel"]["lora_b"], 0)


# ------------------------------------------------------------------ issue 27: nothing silent

def _tiny_tree(seed=0):
    rs = np.random.RandomState(seed)
    return {"layer": {"q": {"kernel": rs.randn(6, 4).astype(np.float32)},
                      "norm": {"scale": rs.randn(4).astype(np.float32)}},
            "head": {"kernel": rs.randn(4, 3).astype(np.float32)}}


def test_merge_refuses_trees_it_would_ignore_with_the_trainable_head_recipe():
    base = _tiny_tree()
    lora = LoRA(rank=2, targets="q/kernel")
    adapters = lora.init(base)
    with pytest.raises(ConfigError, match=r"(?s)head/kernel.*never train.*params\['head'\]"):
        lora.merge(base, dict(adapters, head=base["head"]))  # the head would get no gradient
    with pytest.raises(ConfigError, match="full base"):
        lora.merge(base, base)  # merges nothing
    with pytest.raises(ConfigError, match="not the pair"):
        lora.merge(base, {"layer": {"q": {"kernel": {"lora_a": np.zeros((6, 2), np.float32)}}}})
    # the recipe of the message trains the head: its gradient is not zero
    params = {"adapters": adapters, "head": base["head"]}

    def loss(params):
        merged = {**lora.merge(base, params["adapters"]), "head": params["head"]}
        return jnp.sum(jnp.ones((1, 6)) @ merged["layer"]["q"]["kernel"] @ merged["head"]["kernel"])
    assert float(jnp.abs(jax.grad(loss)(params)["head"]["kernel"]).max()) > 0


def test_merge_without_frozen_params_is_a_clear_error():
    def loss_fn(rng, state, params, batch, is_training):
        return _lm_loss(state.apply_fn, lora.merge(state.frozen_params, params), batch["ids"])
    model, base = _model()
    lora = LoRA(rank=2)
    trainer = Trainer(Deployer(n_model_shards=1, verbose=False), _collate, model.apply, loss_fn,
                      lora.init(base), optax.sgd(0.1), fsdp=False, fuse_matmuls=False)
    with pytest.raises(ConfigError, match=r"frozen_params=base"):
        trainer.train(_examples(8), per_device_batch_size=1)


@pytest.mark.parametrize("container", ["int_keys", "list"])
def test_layers_keyed_by_ints_or_in_a_list(container):
    """nnx.to_pure_dict gives int keys for an nnx.List; plain code may hold a Python list."""
    rs = np.random.RandomState(0)
    layers = [{"q": {"kernel": rs.randn(5, 4).astype(np.float32)}} for _ in range(2)]
    base = {"layers": dict(enumerate(layers)) if container == "int_keys" else layers}
    lora = LoRA(rank=2, alpha=2.0, targets="q/kernel")
    adapters = _random_adapters(lora, base)
    merged = lora.merge(base, adapters)
    assert type(merged["layers"]) is type(base["layers"])
    for i in range(2):
        pair = adapters["layers"][i]["q"]["kernel"]
        want = layers[i]["q"]["kernel"] + np.asarray(pair["lora_a"]) @ np.asarray(pair["lora_b"])
        np.testing.assert_allclose(merged["layers"][i]["q"]["kernel"], want, rtol=1e-6, atol=1e-6)
        assert base["layers"][i]["q"]["kernel"] is layers[i]["q"]["kernel"]  # input unchanged


def test_adapters_keyed_by_ints_save_and_load(tmp_path):
    base = {"layers": {0: {"q": {"kernel": np.ones((5, 4), np.float32)}}}}
    lora = LoRA(rank=2, targets="q/kernel")
    adapters = _random_adapters(lora, base)
    save_adapters(lora, adapters, str(tmp_path / "a"))
    _, loaded = load_adapters(str(tmp_path / "a"))
    np.testing.assert_array_equal(loaded["layers"][0]["q"]["kernel"]["lora_b"],
                                  adapters["layers"][0]["q"]["kernel"]["lora_b"])


def test_truncated_adapters_file_is_named_with_the_fix(tmp_path):
    base = _tiny_tree()
    lora = LoRA(rank=2, targets="q/kernel")
    save_adapters(lora, lora.init(base), str(tmp_path))
    weights = tmp_path / "adapters.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(ConfigError, match=r"adapters\.safetensors.*damaged or incomplete.*Fix"):
        load_adapters(str(tmp_path))


def test_rank_above_the_kernel_dimensions_is_refused():
    base = _tiny_tree()
    with pytest.raises(ConfigError, match=r"rank=5 exceeds .*layer/q/kernel.*at most 4"):
        LoRA(rank=5, targets="q/kernel").init(base)
    LoRA(rank=4, targets="q/kernel").init(base)  # full rank: allowed


def test_fingerprint_is_the_same_on_any_mesh_and_tells_bases_apart():
    from redcoast.store.fingerprint import fingerprint
    _, base = _model()
    one = fingerprint(base)
    mesh = jax.make_mesh((4, 2), ("dp", "mp"))
    placed = jax.tree_util.tree_map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(*(["mp"] if x.shape[0] % 2 == 0 else [])))), base)
    assert fingerprint(placed) == one
    q = jnp.asarray(base["layers"]["0"]["self_attn"]["q_proj"]["kernel"])
    for changed in (q[::-1], q.at[3, 5].add(1e-6), q.astype(jnp.bfloat16)):
        other = jax.tree_util.tree_map(lambda x: x, base)
        other["layers"]["0"]["self_attn"]["q_proj"]["kernel"] = changed
        assert fingerprint(other) != one


@pytest.mark.slow  # a run with checkpoints and a second one refused: ~8 s on the loaded 2-core box
def test_resuming_adapters_on_another_base_is_a_clear_error(tmp_path):
    from redcoast.errors import CheckpointError
    _, base = _model()
    _, other = _model(seed=7)  # the same shapes, other weights
    lora = LoRA(rank=2, alpha=4)
    examples = _examples(16)

    def run(frozen, n_epochs):
        def loss_fn(rng, state, params, batch, is_training):
            return _lm_loss(state.apply_fn, lora.merge(state.frozen_params, params), batch["ids"])
        model, _ = _model()
        deployer = Deployer(jax_seed=0, n_model_shards=1, verbose=False, workdir=str(tmp_path))
        trainer = Trainer(deployer, _collate, model.apply, loss_fn, lora.init(base),
                          optax.adam(1e-2), frozen_params=frozen, fsdp=False, fuse_matmuls=False)
        trainer.fit(examples, per_device_batch_size=2, n_epochs=n_epochs, save_every_k_epochs=1)
        return trainer

    run(base, 1)
    saved = sorted(p.name for p in (tmp_path / "checkpoints" / "steps").iterdir())
    with pytest.raises(CheckpointError, match=r"(?s)other frozen_params.*values of 1 of.*Fix"):
        run(jax.tree_util.tree_map(lambda x: x, {**base, "norm": other["norm"]}), 2)
    with pytest.raises(CheckpointError, match=r"no frozen_params"):
        Trainer(Deployer(n_model_shards=1, verbose=False), _collate, _model()[0].apply,
                lambda *a: 0.0, lora.init(base), optax.adam(1e-2), fsdp=False,
                fuse_matmuls=False).restore_checkpoint(
            __import__("redcoast.store.checkpoint", fromlist=["x"]).CheckpointStore(
                str(tmp_path / "checkpoints" / "steps")))
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "steps").iterdir()) == saved
    # (the same base resumes: test_checkpoints_hold_the_adapters_and_resume_with_the_base_given_again)


# ------------------------------------------------------------------ PEFT's format

def _peft_env():
    torch = pytest.importorskip("torch", reason="test-only reference: pip install torch==2.13.0")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft", reason="test-only reference: pip install peft")
    return torch, transformers, peft


def test_peft_format_key_names_and_round_trip(tmp_path):
    from redcoast.models import load_peft_adapters, save_peft_adapters
    model, base = _model()
    lora = LoRA(rank=4, alpha=8, targets=r"(q_proj|v_proj|down_proj)/kernel$")
    adapters = _random_adapters(lora, base)
    save_peft_adapters(model, lora, adapters, str(tmp_path))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == \
        ("LORA", "CAUSAL_LM", 4, 8.0)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert not config["fan_in_fan_out"]
    from safetensors.numpy import load_file
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 3 * 2
    a = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    pair = adapters["layers"]["1"]["self_attn"]["v_proj"]["kernel"]
    assert a.shape == (4, 32) and b.shape == (16, 4)  # PyTorch's Linear: (out, in)
    np.testing.assert_array_equal(a, np.asarray(pair["lora_a"]).T)
    np.testing.assert_array_equal(b, np.asarray(pair["lora_b"]).T)
    lora2, loaded = load_peft_adapters(str(tmp_path), model)
    assert (lora2.rank, lora2.scale) == (4, 2.0)
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, adapters)
    ids = jnp.asarray(_collate(_examples(2))["ids"])
    np.testing.assert_array_equal(jax.jit(model.apply)(lora2.merge(base, loaded), ids),
                                  jax.jit(model.apply)(lora.merge(base, adapters), ids))


@pytest.mark.slow  # two transformers models and a PEFT model: ~10 s on the loaded 2-core box
def test_peft_loads_our_adapters_and_we_load_peft_s(tmp_path):
    torch, transformers, peft = _peft_env()
    from hf_reference import randomize
    from redcoast.models import from_pretrained, load_peft_adapters, save_peft_adapters

    randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))).save_pretrained(
        str(tmp_path / "base"))
    model, base = from_pretrained(str(tmp_path / "base"))
    ids = np.stack([e["ids"] for e in _examples(3, seed=5)])
    apply = jax.jit(model.apply)

    def torch_logits(m):
        with torch.no_grad():
            return m(torch.tensor(ids)).logits.float().numpy()

    # ours -> PEFT
    lora = LoRA(rank=4, alpha=8, targets=r"(q_proj|v_proj|down_proj)/kernel$")
    adapters = _random_adapters(lora, base)
    save_peft_adapters(model, lora, adapters, str(tmp_path / "ours"))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).eval()
    theirs = torch_logits(peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "ours")).eval())
    ours = np.asarray(apply(lora.merge(base, adapters), jnp.asarray(ids)))
    assert np.abs(ours - np.asarray(apply(base, jnp.asarray(ids)))).max() > 0.1
    print("ours -> PEFT: max |logits difference|", np.abs(theirs - ours).max())
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)

    # PEFT -> ours
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).eval()
    config = peft.LoraConfig(r=3, lora_alpha=5, target_modules=["k_proj", "o_proj", "up_proj"])
    peft_model = peft.get_peft_model(hf_base, config)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    peft_model.save_pretrained(str(tmp_path / "theirs"))
    theirs = torch_logits(peft_model.eval())
    lora2, loaded = load_peft_adapters(str(tmp_path / "theirs"), model)
    assert (lora2.rank, lora2.scale) == (3, 5 / 3)
    assert sorted(loaded["layers"]["0"]["self_attn"]) == ["k_proj", "o_proj"]
    ours = np.asarray(apply(lora2.merge(base, loaded), jnp.asarray(ids)))
    assert np.abs(ours - np.asarray(apply(base, jnp.asarray(ids)))).max() > 0.1
    print("PEFT -> ours: max |logits difference|", np.abs(theirs - ours).max())
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)


def test_adapters_over_a_base_split_over_the_model_shards_are_no_waste(capsys):
    """The adapters may split nothing over the model shards; the frozen base they merge into
    is split, so the devices share the work: no "nothing to split" warning."""
    model, base = _model()
    trainer = _lora_trainer(2, optax.sgd(0.1), base, LoRA(rank=2, alpha=4))
    trainer.train(_examples(8), per_device_batch_size=2)
    assert any("mp" in str(s.spec) for s in jax.tree_util.tree_leaves(
        jax.tree_util.tree_map(lambda x: x.sharding, trainer.frozen_params)))
    assert "nothing to split" not in capsys.readouterr().err


# ------------------------------------------------------------------ issue 50: PEFT's options

def test_each_a_is_its_own_kernels_draw_as_before_kernels_of_a_shape_were_drawn_together():
    # lora.init draws the A of all kernels of one shape at once (vmapped; one random generator
    # per shape in the program, which XLA:GPU compiles in seconds, not a minute): each must still
    # be uniform(fold_in(key(seed), i), its shape, +-1/sqrt(fan_in)) for the i-th kernel
    _, base = _model()
    lora = LoRA(rank=2, targets=r"(q|k|v|o|gate|up|down)_proj/kernel$",
                rank_pattern={"layers/1/.*q_proj": 4})
    adapters = lora.init(base, seed=7)
    kernels = lora.selected(base)
    assert len(kernels) == 14
    key = jax.random.PRNGKey(7)
    for i, path in enumerate(kernels):
        pair, kernel = adapters, base
        for k in path:
            pair, kernel = pair[k], kernel[k]
        bound = 1.0 / np.sqrt(kernel.shape[0])
        want = jax.random.uniform(jax.random.fold_in(key, i), pair["lora_a"].shape, jnp.float32,
                                  -bound, bound)
        np.testing.assert_array_equal(pair["lora_a"], want, err_msg=str(path))


def test_rank_and_alpha_patterns_and_rslora_scale_each_kernel_as_numpy_does():
    _, base = _model()
    lora = LoRA(rank=2, alpha=4, targets=r"(q_proj|v_proj)/kernel$",
                rank_pattern={"q_proj": 4}, alpha_pattern={"layers/1/.*v_proj": 9},
                use_rslora=True)
    adapters = _random_adapters(lora, base)
    merged = lora.merge(base, adapters)
    for layer, name, rank, alpha in (("0", "q_proj", 4, 4), ("1", "q_proj", 4, 4),
                                     ("0", "v_proj", 2, 4), ("1", "v_proj", 2, 9)):
        pair = adapters["layers"][layer]["self_attn"][name]["kernel"]
        kernel = base["layers"][layer]["self_attn"][name]["kernel"]
        assert pair["lora_a"].shape[-1] == rank
        want = kernel + alpha / np.sqrt(rank) * np.asarray(pair["lora_a"]) @ pair["lora_b"]
        np.testing.assert_allclose(merged["layers"][layer]["self_attn"][name]["kernel"], want,
                                   rtol=1e-6, atol=1e-6)
    # adapters of another rank than the LoRA gives the kernel: its scale would be wrong
    with pytest.raises(ConfigError, match=r"q_proj/kernel has rank 4; the LoRA gives that "
                       r"kernel rank 2"):
        LoRA(rank=2, alpha=4, targets=r"(q_proj|v_proj)/kernel$").merge(base, adapters)
    with pytest.raises(ConfigError, match=r"rank_pattern\['q'\]=0; it is a positive integer"):
        LoRA(rank_pattern={"q": 0})


def test_dora_starts_at_the_base_and_rescales_each_output_column_to_its_magnitude():
    rs = np.random.RandomState(0)
    params = {"h": {"c_attn": {"kernel": rs.randn(5, 3, 4).astype(np.float32)}},
              "q": {"kernel": rs.randn(6, 5).astype(np.float32)}}
    lora = LoRA(rank=2, alpha=3.0, targets="(c_attn|q)/kernel", use_dora=True)
    start = lora.init(params)
    m = start["h"]["c_attn"]["kernel"]["lora_magnitude"]
    assert m.shape == (3, 4)  # one per output of the fused kernel
    np.testing.assert_allclose(m, np.linalg.norm(params["h"]["c_attn"]["kernel"], axis=0),
                               rtol=1e-6)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6),
                           lora.merge(params, start), params)
    moved = _random_adapters(lora, params)
    for path, flat_out in ((("h", "c_attn", "kernel"), 12), (("q", "kernel"), 5)):
        pair, w = _at(moved, path), _at(params, path)
        w2 = w.reshape(w.shape[0], -1) + 1.5 * np.asarray(pair["lora_a"]) @ np.asarray(
            pair["lora_b"]).reshape(2, -1)
        want = w2 * np.asarray(pair["lora_magnitude"]).reshape(1, flat_out) / np.linalg.norm(
            w2, axis=0, keepdims=True)
        np.testing.assert_allclose(_at(lora.merge(params, moved), path).reshape(w2.shape), want,
                                   rtol=1e-5, atol=1e-6)
    no_dora = LoRA(rank=2, alpha=3.0, targets="(c_attn|q)/kernel")
    with pytest.raises(ConfigError, match="holds DoRA's 'lora_magnitude' while the LoRA has "
                       "use_dora=False"):
        no_dora.merge(params, moved)


def test_modules_to_save_and_biases_are_trained_whole_and_put_in_place():
    rs = np.random.RandomState(0)
    params = {"layer": {"q": {"kernel": rs.randn(6, 4).astype(np.float32),
                              "bias": rs.randn(4).astype(np.float32)},
                        "k": {"kernel": rs.randn(6, 4).astype(np.float32),
                              "bias": rs.randn(4).astype(np.float32)},
                        "norm": {"scale": rs.randn(4).astype(np.float32),
                                 "bias": rs.randn(4).astype(np.float32)}},
              "head": {"kernel": rs.randn(4, 3).astype(np.float32)}}
    only = LoRA(rank=2, targets="q/kernel", modules_to_save=r"^head/", bias="lora_only")
    every = LoRA(rank=2, targets="q/kernel", bias="all")
    assert sorted(map("/".join, only.whole(params))) == ["head/kernel", "layer/q/bias"]
    assert sorted(map("/".join, every.whole(params))) == [
        "layer/k/bias", "layer/norm/bias", "layer/q/bias"]
    adapters = only.init(params)
    np.testing.assert_array_equal(adapters["head"]["kernel"], params["head"]["kernel"])
    trained = jax.tree_util.tree_map(lambda x: x + 1.0, adapters)
    merged = only.merge(params, trained)
    np.testing.assert_array_equal(merged["head"]["kernel"], params["head"]["kernel"] + 1)
    np.testing.assert_array_equal(merged["layer"]["q"]["bias"], params["layer"]["q"]["bias"] + 1)
    assert merged["layer"]["k"]["bias"] is params["layer"]["k"]["bias"]

    def loss(adapters):
        merged = only.merge(params, adapters)
        h = jnp.ones((1, 6)) @ merged["layer"]["q"]["kernel"] + merged["layer"]["q"]["bias"]
        return jnp.sum(h @ merged["head"]["kernel"])
    grads = jax.grad(loss)(adapters)
    assert float(jnp.abs(grads["head"]["kernel"]).max()) > 0
    assert float(jnp.abs(grads["layer"]["q"]["bias"]).max()) > 0
    # a leaf the LoRA does not train whole is still refused, naming modules_to_save as the fix
    with pytest.raises(ConfigError, match=r"(?s)layer/k/bias.*modules_to_save=r'\^head/'"):
        only.merge(params, dict(adapters, layer=dict(adapters["layer"], k={"bias": np.ones(4)})))
    with pytest.raises(ConfigError, match="both adapted .targets. and trained whole"):
        LoRA(rank=2, targets="q/kernel", modules_to_save="q/").init(params)


def test_every_option_saves_and_loads_in_redcoast_s_format(tmp_path):
    model, base = _model()
    lora = LoRA(rank=2, alpha=4, targets=r"(q_proj|v_proj)/kernel$", rank_pattern={"q_proj": 3},
                alpha_pattern={"v_proj": 5.0}, use_rslora=True, use_dora=True,
                modules_to_save=(r"^lm_head/",), bias="lora_only")
    adapters = _random_adapters(lora, base)
    save_adapters(lora, adapters, str(tmp_path))
    lora2, loaded = load_adapters(str(tmp_path))
    assert lora2 == lora
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, adapters)
    ids = jnp.asarray(_collate(_examples(2))["ids"])
    np.testing.assert_array_equal(jax.jit(model.apply)(lora2.merge(base, loaded), ids),
                                  jax.jit(model.apply)(lora.merge(base, adapters), ids))


@pytest.mark.slow  # a Trainer fit: 33 s on the shared 2-core box (load average 12)
def test_dora_adapters_and_a_head_trained_whole_train_and_the_loss_falls():
    model, base = _model()
    kept = jax.tree_util.tree_map(np.array, base)
    lora = LoRA(rank=4, alpha=8, targets=r"(q_proj|v_proj|up_proj)/kernel$", use_dora=True,
                modules_to_save=r"^lm_head/")
    trainer = _lora_trainer(1, optax.adam(3e-2), base, lora)
    examples = _examples(32)
    before = trainer.eval_loss(examples, 4)
    trainer.fit(examples, per_device_batch_size=4, n_epochs=4)
    after = trainer.eval_loss(examples, 4)
    assert after < 0.7 * before, (before, after)
    jax.tree_util.tree_map(np.testing.assert_array_equal, trainer.frozen_params, kept)
    trained = trainer.params
    assert not np.allclose(trained["lm_head"]["kernel"], kept["lm_head"]["kernel"])
    magnitude = trained["layers"]["0"]["mlp"]["up_proj"]["kernel"]["lora_magnitude"]
    assert not np.allclose(magnitude, np.linalg.norm(kept["layers"]["0"]["mlp"]["up_proj"][
        "kernel"], axis=0))
