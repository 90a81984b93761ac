"""Layers stacked and run by a scan (``scan_layers=True``) against the same model unrolled: the
same numbers, the same Hugging Face folders, the same sharded training; and one traced layer
whatever the depth."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redcoast
from redcoast import Deployer, Trainer
from redcoast.errors import ConfigError
from redcoast.models import Model, from_pretrained, llama, opt, save_pretrained
from redcoast.models.generate import generate

V = 64
TINY = llama.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {  # three layers each
    "llama": (llama.LlamaForCausalLM, TINY),
    "opt": (opt.OPTForCausalLM, opt.Config(vocab_size=V, hidden_size=32, num_hidden_layers=3,
                                           ffn_dim=48, num_attention_heads=4,
                                           max_position_embeddings=64)),
}


def _pair(family="llama", **overrides):
    module, config = FAMILIES[family]
    config = dataclasses.replace(config, **overrides)
    return (Model(module, config), Model(module, dataclasses.replace(config, scan_layers=True)))


def _stacked(layers, n_layers):
    """``{"0": layer, "1": ...}`` as one tree of stacked leaves."""
    return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[layers[str(i)] for i in range(n_layers)])


def _stack(params, n_layers):
    """Unrolled params (``layers/0``, ``layers/1``, ...) with the layers stacked."""
    return dict(params, layers=_stacked(params["layers"], n_layers))


def _assert_equal_trees(a, b, **tol):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path),
                                   **tol)


def _batch(seed=0, rows=2, length=9):
    ids = jax.random.randint(jax.random.key(seed), (rows, length), 0, V)
    mask = jnp.ones((rows, length), jnp.int32).at[0, :3].set(0)  # row 0 left-padded
    return ids, mask


@pytest.mark.parametrize("family, remat", [("llama", False), ("llama", True), ("opt", False)])
def test_a_scanned_model_computes_what_the_unrolled_one_does(family, remat):
    unrolled, scanned = _pair(family, remat=remat)
    params = unrolled.init(0)
    stacked = _stack(params, TINY.num_hidden_layers)
    assert stacked["layers"]["self_attn"]["q_proj"]["kernel"].shape == (3, 32, 32)
    assert jax.tree_util.tree_structure(stacked) == jax.tree_util.tree_structure(
        scanned.abstract_params())
    ids, mask = _batch()
    # each computation jitted whole: run op by op, the unrolled gradient alone took ~7 s here
    _assert_equal_trees(jax.jit(scanned.apply)(stacked, ids, mask),
                        jax.jit(unrolled.apply)(params, ids, mask), atol=1e-6, rtol=0)

    def grad(model):
        return jax.jit(jax.grad(lambda p: (model.apply(p, ids, mask) ** 2).mean()))
    _assert_equal_trees(grad(scanned)(stacked),
                        _stack(grad(unrolled)(params), TINY.num_hidden_layers),
                        atol=1e-7, rtol=1e-5)
    if family == "llama" and not remat:  # decoding with a cache reads one layer at a time
        np.testing.assert_array_equal(generate(scanned, stacked, ids, mask, max_new_tokens=4),
                                      generate(unrolled, params, ids, mask, max_new_tokens=4))


def test_each_stacked_layer_is_initialised_from_its_own_key():
    _, scanned = _pair()
    q = np.asarray(scanned.init(0)["layers"]["self_attn"]["q_proj"]["kernel"])
    assert 0.015 < q.std() < 0.025  # the layer's own initialiser (normal, 0.02)
    assert not np.allclose(q[0], q[1]) and not np.allclose(q[1], q[2])


def test_the_scan_traces_one_layer_whatever_the_depth():
    def n_matmuls(config):
        model = Model(llama.LlamaForCausalLM, config)
        jaxpr = jax.make_jaxpr(model.apply)(model.abstract_params(), _batch()[0])
        return str(jaxpr).count("dot_general")
    deep = dataclasses.replace(TINY, num_hidden_layers=8)
    assert n_matmuls(dataclasses.replace(deep, scan_layers=True)) == n_matmuls(
        dataclasses.replace(TINY, num_hidden_layers=1, scan_layers=True))
    assert n_matmuls(deep) > n_matmuls(TINY)  # the unrolled model traces every layer
    from redcoast.models import t5  # T5 too, the decoder's cross-attention K/V included

    def t5_matmuls(layers):
        model = Model(t5.T5ForConditionalGeneration, t5.Config(
            vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=layers, num_heads=4,
            scan_layers=True))
        ids = _batch()[0]
        return str(jax.make_jaxpr(model.apply)(model.abstract_params(), ids, None, ids)).count(
            "dot_general")
    assert t5_matmuls(6) == t5_matmuls(1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_folders_hold_one_tensor_per_layer_both_ways(tmp_path, family):
    unrolled, _ = _pair(family)
    params = unrolled.init(0)
    save_pretrained(unrolled, params, str(tmp_path / "unrolled"))
    model, stacked = from_pretrained(str(tmp_path / "unrolled"),
                                     config_overrides={"scan_layers": True})
    assert model.config.scan_layers
    _assert_equal_trees(stacked, _stack(params, TINY.num_hidden_layers), atol=0, rtol=0)
    save_pretrained(model, stacked, str(tmp_path / "scanned"))
    names = lambda d: sorted(redcoast.models.hf.SafetensorsFolder(str(tmp_path / d)).names())  # noqa: E731
    assert names("scanned") == names("unrolled")
    assert any(n.endswith("layers.2.self_attn.q_proj.weight") for n in names("scanned"))
    _, back = from_pretrained(str(tmp_path / "scanned"))  # read unrolled again: bitwise
    _assert_equal_trees(back, params, atol=0, rtol=0)


def test_a_stacked_parameter_loads_split_and_each_device_reads_its_rows(tmp_path):
    unrolled, _ = _pair()
    params = unrolled.init(0)
    save_pretrained(unrolled, params, str(tmp_path / "m"))
    deployer = Deployer(n_model_shards=2, verbose=False)
    model, stacked = from_pretrained(str(tmp_path / "m"), deployer,
                                     config_overrides={"scan_layers": True})
    q = stacked["layers"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec[0] is None and "mp" in q.sharding.spec  # heads split, layers whole
    assert q.addressable_shards[0].data.shape == (3, 32, 16)
    _assert_equal_trees(stacked, _stack(params, TINY.num_hidden_layers), atol=0, rtol=0)


def test_layers_with_different_windows_cannot_be_scanned():
    with pytest.raises(ConfigError, match="scan_layers=False"):
        dataclasses.replace(TINY, sliding_window=4, layer_types=(
            "full_attention", "sliding_attention", "full_attention"), scan_layers=True)


def _lm_loss(model):
    def loss(rng, state, params, batch, is_training):
        logits = model.apply(params, batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()
    return loss


def test_a_scanned_llama_trains_on_2x4_like_the_unrolled_one():
    """Through the Trainer with every default on 8 simulated devices, mp=2: the plan splits the
    stacked Q/K/V by heads as it splits each unrolled layer's, and two updates agree (SGD: Adam
    would turn the summation order's rounding of near-zero gradients into whole steps)."""
    rng = np.random.default_rng(0)
    examples = [{"ids": rng.integers(0, V, 9).astype(np.int32)} for _ in range(16)]
    collate = lambda rows: {"ids": np.stack([r["ids"] for r in rows])}  # noqa: E731
    trained = {}
    unrolled_params = _pair()[0].init(0)
    for name, model, params in zip(("unrolled", "scanned"), _pair(),
                                   (unrolled_params, _stack(unrolled_params, 3))):
        trainer = Trainer(Deployer(n_model_shards=2, jax_seed=0, verbose=False), collate,
                          model.apply, _lm_loss(model), params, optax.sgd(0.05, momentum=0.9))
        trainer.train(examples, per_device_batch_size=2, shuffle=False)
        trained[name] = trainer
    def specs(trainer, prefix):  # {path below prefix: spec over every axis}
        return {pl.path[len(prefix):]: tuple(pl.spec) + (None,) * (len(pl.shape) - len(pl.spec))
                for pl in trainer.plan.placements if pl.path[:len(prefix)] == prefix}
    unrolled = specs(trained["unrolled"], ("layers", "0"))
    scanned = specs(trained["scanned"], ("layers",))
    assert scanned == {path: (None, *spec) for path, spec in unrolled.items()}
    assert "mp" in scanned[("self_attn", "q_proj", "kernel")]
    _assert_equal_trees(trained["scanned"].params,
                        _stack(trained["unrolled"].params, TINY.num_hidden_layers),
                        atol=2e-6, rtol=1e-5)


def test_lora_adapts_each_stacked_layer_as_each_unrolled_one():
    from redcoast.lora import LoRA
    from redcoast.models.peft import save_peft_adapters
    unrolled, scanned = _pair()
    params = unrolled.init(0)
    per_layer = LoRA(rank=2).init(params)
    # B starts at zero (the base model exactly): give it values so that the merge shows
    per_layer = jax.tree_util.tree_map(lambda a: a + 0.05, per_layer)
    stacked_adapters = _stack(per_layer, TINY.num_hidden_layers)
    lora = LoRA(rank=2, stack_dims=1)  # the kernels' first axis: the layers
    merged = lora.merge(_stack(params, TINY.num_hidden_layers), stacked_adapters)
    _assert_equal_trees(merged, _stack(LoRA(rank=2).merge(params, per_layer),
                                       TINY.num_hidden_layers), atol=1e-7, rtol=0)
    with pytest.raises(ConfigError, match="scan_layers=True"):
        save_peft_adapters(scanned, lora, stacked_adapters, "unused")


MEDIUM = dict(vocab_size=V, hidden_size=256, intermediate_size=1024, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)


def _fsdp_trainer(model, params):
    rng = np.random.default_rng(0)
    examples = [{"ids": rng.integers(0, V, 17).astype(np.int32)} for _ in range(16)]
    collate = lambda rows: {"ids": np.stack([r["ids"] for r in rows])}  # noqa: E731
    trainer = Trainer(Deployer(n_model_shards=2, jax_seed=0, verbose=False), collate,
                      model.apply, _lm_loss(model), params, optax.sgd(0.05, momentum=0.9),
                      fsdp=True, fuse_matmuls=True)
    return trainer, examples, collate


def test_fsdp_gathers_a_stacked_weight_one_layer_at_a_time(monkeypatch):
    """dp=4 x mp=2 with FSDP: the MLP's stacked kernels (3 MiB each) are stored split over 'dp'.
    Gathered whole where the loss starts, every layer's weights would be held at once; kept
    split into the scan, each iteration gathers its own layer. Two updates equal the unrolled
    model's."""
    from redcoast.layout import steps
    config = llama.LlamaConfig(**MEDIUM, remat=True)
    unrolled, scanned = (Model(llama.LlamaForCausalLM, config),
                         Model(llama.LlamaForCausalLM, dataclasses.replace(config, scan_layers=True)))
    params = unrolled.init(0)
    trainer, examples, collate = _fsdp_trainer(scanned, _stack(params, 3))
    batch = collate(examples[:8])
    gate = [pl for pl in trainer.plan.placements if pl.path == ("layers", "mlp", "gate_proj", "kernel")]
    assert "dp" in str(gate[0].spec)  # FSDP splits the stacked kernel
    per_layer = trainer.compile_train_step(batch).memory_analysis().temp_size_in_bytes
    with monkeypatch.context() as m:  # the same step with every parameter gathered at the start
        m.setattr(steps, "_gathered_in_scans", lambda closed, weights, compute, stored: (compute, {}))
        whole = _fsdp_trainer(scanned, _stack(params, 3))[0].compile_train_step(batch)
    gathered_mlp = 3 * 3 * 256 * 1024 * 4 // 2  # the three MLP stacks over the 2 model shards
    assert whole.memory_analysis().temp_size_in_bytes - per_layer > gathered_mlp / 2
    trainer.train(examples, per_device_batch_size=2, shuffle=False)
    reference, _, _ = _fsdp_trainer(unrolled, params)
    reference.train(examples, per_device_batch_size=2, shuffle=False)
    _assert_equal_trees(trainer.params, _stack(reference.params, 3), atol=2e-6, rtol=1e-5)


def test_inside_the_scan_the_step_moves_the_unrolled_steps_bytes_over_each_axis():
    """dp=2 x mp=4, FSDP on every tensor (norm scales split over all eight devices): each layer
    is gathered where it is used, so the hidden state in the loop stays split by rows as in the
    unrolled step, and the step's collectives move the same bytes along 'dp', along 'mp' and
    along both. Left to the partitioner, the layers' splits spread onto the hidden state (its
    features over all eight devices: 1.7x the bytes along 'mp'; jax 0.11.2's partitioner
    aborted the process)."""
    from redcoast.layout.comms import collective_report
    config = dataclasses.replace(TINY, hidden_size=64, intermediate_size=128,
                                 num_attention_heads=8, num_key_value_heads=4)
    unrolled, scanned = (Model(llama.LlamaForCausalLM, config),
                         Model(llama.LlamaForCausalLM, dataclasses.replace(config, scan_layers=True)))
    params = unrolled.init(0)
    batch = {"ids": np.random.default_rng(0).integers(0, V, (8, 17)).astype(np.int32)}
    moved = []
    for model, p in ((unrolled, params), (scanned, _stack(params, 3))):
        trainer = Trainer(Deployer(n_model_shards=4, jax_seed=0, verbose=False), lambda rows: rows,
                          model.apply, _lm_loss(model), p, optax.sgd(0.1), fsdp=True,
                          fuse_matmuls=True)
        report = collective_report(trainer.compile_train_step(batch), trainer.mesh)
        moved.append({axis: wire for axis, (_, _, wire) in report.by_axis().items()})
    assert moved[1] == moved[0]


def test_a_scanned_t5_computes_what_the_unrolled_one_does(tmp_path):
    """Encoder and decoder blocks stacked (each decoder layer's cross-attention K/V scanned with
    it): logits and gradients of teacher forcing, cached generation and folders as unrolled."""
    from redcoast.models import t5
    from redcoast.models.generate_seq2seq import generate as generate_seq2seq
    config = t5.Config(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=3,
                       num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                       tie_word_embeddings=False, remat=True)
    unrolled = Model(t5.T5ForConditionalGeneration, config)
    scanned = Model(t5.T5ForConditionalGeneration, dataclasses.replace(config, scan_layers=True))
    params = unrolled.init(0)
    stacked = dict(params)
    for name, n in (("encoder", 3), ("decoder", 2)):
        stacked[name] = dict(params[name], blocks=_stacked(params[name]["blocks"], n))
    assert jax.tree_util.tree_structure(stacked) == jax.tree_util.tree_structure(
        scanned.abstract_params())
    ids, mask = _batch()
    dec = ids[:, :5]
    want = jax.jit(unrolled.apply)(params, ids, mask, dec)  # logits of order 10 (N(0, 1) embedding)
    _assert_equal_trees(jax.jit(scanned.apply)(stacked, ids, mask, dec), want,
                        atol=1e-6 * float(np.abs(want).max()), rtol=0)
    grads = [jax.jit(jax.grad(lambda p, m=m: (m.apply(p, ids, mask, dec) ** 2).mean()))(p)
             for m, p in ((scanned, stacked), (unrolled, params))]
    # each leaf to 1e-5 of its own scale: T5's activations are of order 10 and more (N(0, 1)
    # embeddings, unscaled attention), so float32 summation order alone moves ~1e-6 of it
    for (path, got), want in zip(
            jax.tree_util.tree_leaves_with_path(grads[0]["decoder"]["blocks"]),
            jax.tree_util.tree_leaves(_stacked(grads[1]["decoder"]["blocks"], 2))):
        np.testing.assert_allclose(got, want, atol=1e-5 * float(np.abs(want).max()), rtol=0,
                                   err_msg=jax.tree_util.keystr(path))
    np.testing.assert_array_equal(
        generate_seq2seq(scanned, stacked, ids, mask, max_new_tokens=4),
        generate_seq2seq(unrolled, params, ids, mask, max_new_tokens=4))
    save_pretrained(scanned, stacked, str(tmp_path / "scanned"))
    _, back = from_pretrained(str(tmp_path / "scanned"))  # read unrolled: bitwise
    _assert_equal_trees(back, params, atol=0, rtol=0)
