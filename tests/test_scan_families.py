"""GPT-2, GPT-J, BART, BERT and ViT with their layers stacked and run by a scan
(``scan_layers=True``) against the same models unrolled: the same outputs and gradients, the
same Hugging Face folders (transformers' logits from a scanned model), cached decoding, and the
tensor-parallel split the plan derives for each layer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from redcoast import Deployer, Trainer
from redcoast.errors import ConfigError
from redcoast.models import Model, bart, bert, from_pretrained, gpt2, gptj, save_pretrained, vit

V = 64


def _ids(seed=0, rows=2, length=9):
    """``(ids, mask)``: row 0 left-padded."""
    ids = jax.random.randint(jax.random.key(seed), (rows, length), 3, V)
    return ids, jnp.ones((rows, length), jnp.int32).at[0, :3].set(0)


def _lm_inputs():
    return _ids()


def _seq2seq_inputs():
    ids, mask = _ids()
    dec, _ = _ids(1, length=5)
    return ids, mask, dec, jnp.ones_like(dec).at[1, 3:].set(0)  # decoder row 1 right-padded


def _pixels():
    return (jax.random.normal(jax.random.key(0), (2, 3, 16, 16)),)


# three layers each (BART: three in the encoder, two in the decoder), widths 32, 4 heads
FAMILIES = {
    "gpt2": (gpt2.GPT2LMHeadModel, gpt2.Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=3,
                                               n_head=4), _lm_inputs),
    "gptj": (gptj.GPTJForCausalLM, gptj.Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=3,
                                               n_head=4, rotary_dim=4, n_inner=48), _lm_inputs),
    "bart": (bart.BartForConditionalGeneration, bart.Config(
        vocab_size=V, max_position_embeddings=32, d_model=32, encoder_layers=3, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
        decoder_ffn_dim=40), _seq2seq_inputs),
    "bert": (bert.BertModel, bert.Config(vocab_size=V, hidden_size=32, num_hidden_layers=3,
                                         num_attention_heads=4, intermediate_size=48,
                                         max_position_embeddings=32), _lm_inputs),
    "bert_classifier": (bert.BertForSequenceClassification, bert.Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=32), _lm_inputs),
    "vit": (vit.ViTModel, vit.Config(image_size=16, patch_size=4, hidden_size=32,
                                     num_hidden_layers=3, num_attention_heads=4,
                                     intermediate_size=48), _pixels),
}


def _pair(family, **overrides):
    module, config, _ = FAMILIES[family]
    config = dataclasses.replace(config, **overrides)
    return Model(module, config), Model(module, dataclasses.replace(config, scan_layers=True))


def _is_layer_dict(node):
    return (isinstance(node, dict) and len(node) > 0
            and sorted(node) == sorted(str(i) for i in range(len(node))))


def _stack(params):
    """Unrolled params with every ``{"0": layer, "1": ...}`` stacked into one tree of arrays
    ``[layers, ...]`` (as the scanned model holds them)."""
    if _is_layer_dict(params):
        return jax.tree_util.tree_map(lambda *a: jnp.stack(a),
                                      *[params[str(i)] for i in range(len(params))])
    if isinstance(params, dict):
        return {k: _stack(v) for k, v in params.items()}
    return params


def _assert_equal_trees(a, b, **tol):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path),
                                   **tol)


def _scalar(outputs):
    """A loss of every float output (logits, or hidden states and pooled output)."""
    return sum((o.astype(jnp.float32) ** 2).mean() for o in jax.tree_util.tree_leaves(outputs))


@pytest.mark.parametrize("family, remat", [(f, False) for f in FAMILIES]
                         + [("gpt2", True), ("bart", True)])
def test_a_scanned_family_computes_what_the_unrolled_one_does(family, remat):
    """Outputs and gradients of the same params (restacked), each computation jitted whole."""
    unrolled, scanned = _pair(family, remat=remat)
    params = unrolled.init(0)
    stacked = _stack(params)
    assert jax.tree_util.tree_structure(stacked) == jax.tree_util.tree_structure(
        scanned.abstract_params())
    inputs = FAMILIES[family][2]()
    _assert_equal_trees(jax.jit(scanned.apply)(stacked, *inputs),
                        jax.jit(unrolled.apply)(params, *inputs), atol=1e-6, rtol=0)

    def grad(model):
        return jax.jit(jax.grad(lambda p: _scalar(model.apply(p, *inputs))))
    _assert_equal_trees(grad(scanned)(stacked), _stack(grad(unrolled)(params)),
                        atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "gptj", "bart"])
def test_scanned_decoders_generate_what_the_unrolled_ones_do(family):
    """Decoding with a KV cache reads one stacked layer at a time (BART: the cross-attention K/V
    of each layer too)."""
    from redcoast.models.generate import generate
    from redcoast.models.generate_seq2seq import generate as generate_seq2seq
    unrolled, scanned = _pair(family)
    params = unrolled.init(0)
    ids, mask = _ids()
    run = generate_seq2seq if family == "bart" else generate
    np.testing.assert_array_equal(run(scanned, _stack(params), ids, mask, max_new_tokens=4),
                                  run(unrolled, params, ids, mask, max_new_tokens=4))


def test_a_scanned_gpt2_attends_to_an_encoder_like_the_unrolled_one():
    """GPT-2 as a VisionEncoderDecoder's text decoder: each block's cross-attention K/V scanned
    with it."""
    unrolled, scanned = _pair("gpt2", add_cross_attention=True)
    params = unrolled.init(0)
    ids, mask = _ids()
    encoder = jax.random.normal(jax.random.key(2), (2, 5, 32))

    def loss(model, p):
        return _scalar(model.apply(p, ids, mask, cross_kv=model.apply(p, encoder,
                                                                    method="cross_kv")))
    assert jax.jit(lambda p: loss(scanned, p))(_stack(params)) == pytest.approx(
        float(jax.jit(lambda p: loss(unrolled, p))(params)), rel=1e-6)
    _assert_equal_trees(jax.jit(jax.grad(lambda p: loss(scanned, p)))(_stack(params)),
                        _stack(jax.jit(jax.grad(lambda p: loss(unrolled, p)))(params)),
                        atol=1e-7, rtol=1e-5)


def test_gpt2_scaled_by_layer_index_cannot_be_scanned():
    with pytest.raises(ConfigError, match="scan_layers=False"):
        gpt2.Config(n_layer=2, scale_attn_by_inverse_layer_idx=True, scan_layers=True)


def test_the_scan_traces_one_layer_whatever_the_depth():
    def n_matmuls(family, **depth):
        module, config, inputs = FAMILIES[family]
        model = Model(module, dataclasses.replace(config, scan_layers=True, **depth))
        return str(jax.make_jaxpr(model.apply)(model.abstract_params(), *inputs())).count(
            "dot_general")
    assert n_matmuls("gpt2", n_layer=8) == n_matmuls("gpt2", n_layer=1)
    assert n_matmuls("bart", encoder_layers=6, decoder_layers=5) == n_matmuls(
        "bart", encoder_layers=1, decoder_layers=1)
    assert n_matmuls("vit", num_hidden_layers=6) == n_matmuls("vit", num_hidden_layers=1)


def _mp_specs(family):
    """{parameter path: its spec over every axis} of the Trainer's plan on 2 model shards."""
    unrolled, scanned = _pair(family)
    params = unrolled.init(0)
    inputs = FAMILIES[family][2]()
    specs = {}
    for name, model, p in (("unrolled", unrolled, params), ("scanned", scanned, _stack(params))):
        def loss(rng, state, params, batch, is_training, model=model):
            return _scalar(model.apply(params, *batch))
        trainer = Trainer(Deployer(n_model_shards=2, jax_seed=0, verbose=False), lambda rows: rows,
                          model.apply, loss, p, optax.sgd(0.1), fuse_matmuls=True)
        # 8 rows: one per data shard of the 4 (dp=4 x mp=2)
        trainer.compile_train_step(tuple(np.tile(np.asarray(x), (4,) + (1,) * (x.ndim - 1))
                                         for x in inputs))
        specs[name] = {pl.path: tuple(pl.spec) + (None,) * (len(pl.shape) - len(pl.spec))
                       for pl in trainer.plan.placements}
    return specs


@pytest.mark.slow  # 50-150 s each on the shared 2-core machine (two steps compiled on 8 devices)
@pytest.mark.parametrize("family", ["gpt2", "bart", "bert", "vit"])
def test_the_plan_splits_each_stacked_layer_as_each_unrolled_one(family):
    """The tensor-parallel split derived from the scanned step: every stacked parameter as the
    unrolled layer 0's, its leading (layers) axis whole; the rest of the model as unrolled."""
    specs = _mp_specs(family)
    want = {}
    for path, spec in specs["unrolled"].items():
        digits = [i for i, key in enumerate(path) if str(key).isdigit()]
        if not digits:
            want[path] = spec
        elif path[digits[0]] == "0":
            want[path[:digits[0]] + path[digits[0] + 1:]] = (None, *spec)
    assert specs["scanned"] == want
    assert any("mp" in spec for spec in want.values())


def _reference(family):
    """``(transformers model, its class, outputs(redcoast model, params) -> arrays, the same
    from the reference)`` of a tiny random ``family`` model."""
    torch = pytest.importorskip("torch")  # the reference: not installed in CI's Python 3.12 step
    transformers = pytest.importorskip("transformers")

    from hf_reference import left_padded, randomize, torch_logits
    ids, mask = left_padded(V)
    t = lambda a: torch.tensor(np.asarray(a))  # noqa: E731
    lm = dict(vocab_size=V, n_positions=32, n_embd=32, n_layer=3, n_head=4, bos_token_id=0,
              eos_token_id=0)
    real = mask.astype(bool)

    def causal(model, params):
        return np.asarray(jax.jit(model.apply)(params, ids, mask))[real]

    if family in ("gpt2", "gptj"):
        cls, config = ((transformers.GPT2LMHeadModel, transformers.GPT2Config(**lm))
                       if family == "gpt2" else
                       (transformers.GPTJForCausalLM,
                        transformers.GPTJConfig(**lm, rotary_dim=4, n_inner=48)))
        ref = randomize(cls(config))
        return ref, cls, causal, lambda: torch_logits(ref, ids, mask)[real]
    if family == "bart":
        cls = transformers.BartForConditionalGeneration
        ref = randomize(cls(transformers.BartConfig(
            vocab_size=V, max_position_embeddings=32, d_model=16, encoder_layers=3,
            decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=32, decoder_ffn_dim=24, dropout=0.0, forced_eos_token_id=None)))
        dec = ids[:, :5]

        def reference():
            with torch.no_grad():
                return ref(input_ids=t(ids), attention_mask=t(mask),
                           decoder_input_ids=t(dec)).logits.numpy()
        return ref, cls, (lambda model, params: np.asarray(
            jax.jit(model.apply)(params, ids, mask, dec))), reference
    if family == "bert":
        cls = transformers.BertModel
        ref = randomize(cls(transformers.BertConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            intermediate_size=48, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)))
        inputs = (ids, mask)
    else:
        cls = transformers.ViTModel
        ref = randomize(cls(transformers.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=3,
            num_attention_heads=4, intermediate_size=48, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)))
        inputs = _pixels()

    def features(model, params):  # the last hidden state and the pooled output
        return [np.asarray(a) for a in jax.jit(model.apply)(params, *inputs)]

    def reference():
        with torch.no_grad():
            out = (ref(input_ids=t(ids), attention_mask=t(mask)) if family == "bert"
                   else ref(pixel_values=t(inputs[0])))
        return [out.last_hidden_state.numpy(), out.pooler_output.numpy()]
    return ref, cls, features, reference


@pytest.mark.parametrize("family", ["gpt2", "gptj", "bart", "bert", "vit"])
def test_a_folder_loads_into_a_scanned_model_and_saves_back_as_it_was(family, tmp_path):
    """A transformers folder read with scan_layers=True: each stacked row is the unrolled
    layer's tensor bitwise, the outputs are transformers', and the folder it writes is the
    unrolled model's (one tensor per layer, the same config.json) which transformers loads to
    the reference's exact tensors."""
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file

    from redcoast.models import hf
    ref, cls, outputs, reference = _reference(family)
    ref.save_pretrained(str(tmp_path / "hf"))
    unrolled_model, unrolled = from_pretrained(str(tmp_path / "hf"))
    model, stacked = from_pretrained(str(tmp_path / "hf"), config_overrides={"scan_layers": True})
    assert model.config.scan_layers and not unrolled_model.config.scan_layers
    _assert_equal_trees(stacked, _stack(unrolled), atol=0, rtol=0)
    want = reference()
    # outputs of order 0.1-1, so that 1e-4 discriminates
    assert max(np.abs(w).max() for w in jax.tree_util.tree_leaves(want)) > 0.3
    _assert_equal_trees(outputs(model, stacked), want, atol=1e-4, rtol=0)
    save_pretrained(model, stacked, str(tmp_path / "scanned"))
    save_pretrained(unrolled_model, unrolled, str(tmp_path / "unrolled"))
    tensors = {d: load_file(str(tmp_path / d / hf.SINGLE_FILE)) for d in ("scanned", "unrolled")}
    assert sorted(tensors["scanned"]) == sorted(tensors["unrolled"])
    for name, value in tensors["unrolled"].items():
        np.testing.assert_array_equal(tensors["scanned"][name], value, err_msg=name)
    assert hf.read_config(str(tmp_path / "scanned")) == hf.read_config(str(tmp_path / "unrolled"))
    back = cls.from_pretrained(str(tmp_path / "scanned")).state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(back[name], value), name
