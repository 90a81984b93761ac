"""PEFT adapters found in the wild (issue 50, item 6) against PEFT itself: folders PEFT writes
with ``modules_to_save`` (a trained head), ``rank_pattern`` / ``alpha_pattern``, rsLoRA,
trained biases (``bias="all"`` / ``"lora_only"``) and DoRA load into redcoast with PEFT's logits,
and the folders redcoast writes for the same adapters load in PEFT with redcoast's logits. The
DoRA gradients of a step equal PEFT's (the column norm held constant, as PEFT does)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from redcoast import ConfigError, LoRA
from redcoast.models import from_pretrained, load_peft_adapters, save_peft_adapters

torch = pytest.importorskip("torch", reason="test-only reference: pip install torch==2.13.0")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="test-only reference: pip install peft")

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
             tie_word_embeddings=False)


def _base_folder(tmp_path, hf_model):
    """The transformers model's weights drawn of order 0.1 (norm scales near 1), saved; the
    folder and redcoast's ``(model, params)`` from it."""
    from hf_reference import randomize

    randomize(hf_model).save_pretrained(str(tmp_path / "base"))
    model, params = from_pretrained(str(tmp_path / "base"))
    return str(tmp_path / "base"), model, params


def _trained(peft_model, seed):
    """Every parameter PEFT trains moved off its initial value, as training would: the LoRA
    pairs drawn, DoRA's magnitudes and the parameters trained whole perturbed."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if not p.requires_grad:
                continue
            if "lora_magnitude_vector" in name:
                p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
            elif "lora_" in name:
                p.normal_(0.0, 0.2)
            else:  # a head in modules_to_save, a bias
                p.add_(0.1 * torch.randn_like(p))
    return peft_model.eval()


def _torch(model, inputs):
    names = ("input_ids", "attention_mask", "token_type_ids")
    with torch.no_grad():
        out = model(**{n: torch.tensor(x, dtype=torch.long) for n, x in zip(names, inputs)})
    return _logits(out)


def _logits(out):
    return (out.logits if hasattr(out, "logits") else out).detach().float().numpy()


def _both_ways(tmp_path, base_folder, model, params, hf_class, config, inputs, seed=3):
    """PEFT's folder for ``config`` loads into redcoast with PEFT's logits; redcoast's folder
    of the same adapters loads into PEFT with redcoast's. Returns (lora, adapters, config)."""
    peft_model = _trained(peft.get_peft_model(hf_class.from_pretrained(base_folder), config), seed)
    peft_model.save_pretrained(str(tmp_path / "theirs"))
    theirs = _torch(peft_model, inputs)
    lora, adapters = load_peft_adapters(str(tmp_path / "theirs"), model)
    apply = jax.jit(model.apply)
    ours = np.asarray(apply(lora.merge(params, adapters), *map(jnp.asarray, inputs)))
    assert np.abs(ours - np.asarray(apply(params, *map(jnp.asarray, inputs)))).max() > 0.1
    print("PEFT -> redcoast: max |logits difference|", np.abs(theirs - ours).max())
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)

    save_peft_adapters(model, lora, adapters, str(tmp_path / "ours"))
    back = peft.PeftModel.from_pretrained(hf_class.from_pretrained(base_folder),
                                          str(tmp_path / "ours")).eval()
    again = _torch(back, inputs)
    print("redcoast -> PEFT: max |logits difference|", np.abs(again - ours).max())
    np.testing.assert_allclose(again, ours, atol=1e-5, rtol=0)
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    return lora, adapters, written


def _ids(vocab, rows=3, t=10, seed=5):
    return (np.random.RandomState(seed).randint(1, vocab, (rows, t))).astype(np.int32)


def test_a_trained_head_and_per_module_ranks_and_alphas_load_both_ways(tmp_path):
    """Llama with modules_to_save=["lm_head"], rank_pattern, alpha_pattern and rsLoRA: before,
    load_peft_adapters refused the folder (modules_to_save, rank_pattern, alpha_pattern)."""
    base, model, params = _base_folder(
        tmp_path, transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)))
    config = peft.LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "v_proj", "down_proj"],
                             modules_to_save=["lm_head"], rank_pattern={"q_proj": 4},
                             alpha_pattern={"model.layers.1.self_attn.v_proj": 7},
                             use_rslora=True)
    lora, adapters, written = _both_ways(tmp_path, base, model, params,
                                         transformers.AutoModelForCausalLM, config,
                                         [_ids(LLAMA["vocab_size"])])
    pair = adapters["layers"]["0"]["self_attn"]
    assert pair["q_proj"]["kernel"]["lora_a"].shape == (32, 4)  # rank_pattern
    assert pair["v_proj"]["kernel"]["lora_a"].shape == (32, 2)
    assert lora.scale_of("layers/1/self_attn/v_proj/kernel") == 7 / np.sqrt(2)
    assert lora.scale_of("layers/0/self_attn/v_proj/kernel") == 3 / np.sqrt(2)
    assert adapters["lm_head"]["kernel"].shape == (32, 64)  # the trained head, (in, out)
    assert (written["rank_pattern"], written["modules_to_save"]) == ({"q_proj": 4}, ["lm_head"])
    assert written["alpha_pattern"] == {r"model\.layers\.1\.self_attn\.v_proj": 7.0}


@pytest.mark.slow  # a BERT, two PEFT models and a compilation: ~8 s on the shared 2-core box
def test_a_classifier_with_dora_and_its_adapted_modules_biases_loads_both_ways(tmp_path):
    """BERT for sequence classification: PEFT trains the classifier whole (modules_to_save
    for SEQ_CLS), bias="lora_only" the adapted modules' biases, use_dora the magnitudes."""
    bert = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=64,
                                   max_position_embeddings=24, num_labels=3)
    base, model, params = _base_folder(tmp_path,
                                       transformers.BertForSequenceClassification(bert))
    config = peft.LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=5,
                             target_modules=["query", "value"], bias="lora_only", use_dora=True)
    ids = _ids(99)
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    lora, adapters, written = _both_ways(
        tmp_path, base, model, params, transformers.AutoModelForSequenceClassification, config,
        [ids, mask, np.zeros_like(ids)])
    assert (lora.use_dora, lora.bias, written["bias"], written["use_dora"]) == \
        (True, "lora_only", "lora_only", True)
    assert written["modules_to_save"] == ["classifier"]


@pytest.mark.slow  # a GPT-2, two PEFT models and a compilation: ~8 s on the shared 2-core box
def test_gpt2_with_every_bias_trained_and_dora_on_its_fused_conv1d_loads_both_ways(tmp_path):
    """GPT-2's c_attn is a Conv1D (fan_in_fan_out) holding q, k and v, kept by redcoast as
    (in, 3, hidden): the DoRA magnitude (3 * hidden,) and bias="all" (layer norms' too)."""
    gpt2 = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                   n_head=4, bos_token_id=0, eos_token_id=0)
    base, model, params = _base_folder(tmp_path, transformers.GPT2LMHeadModel(gpt2))
    config = peft.LoraConfig(r=3, lora_alpha=4, target_modules=["c_attn"], bias="all",
                             use_dora=True, fan_in_fan_out=True)
    lora, adapters, written = _both_ways(tmp_path, base, model, params,
                                         transformers.AutoModelForCausalLM, config, [_ids(64)])
    attn = adapters["h"]["0"]["attn"]
    assert attn["c_attn"]["kernel"]["lora_magnitude"].shape == (3, 32)
    assert attn["c_attn"]["bias"].shape == (3, 32) and "bias" in adapters["h"]["0"]["ln_1"]
    assert (written["bias"], written["fan_in_fan_out"]) == ("all", True)


@pytest.mark.slow  # ~6 s: two PEFT models
def test_a_lora_redcoast_trains_with_every_option_loads_in_peft(tmp_path):
    """Not a round trip: adapters from redcoast's own LoRA(rank_pattern, alpha_pattern,
    use_dora, modules_to_save, bias), moved as training would, written for PEFT."""
    base, model, params = _base_folder(
        tmp_path, transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)))
    lora = LoRA(rank=2, alpha=4, targets=r"(q_proj|v_proj|up_proj)/kernel$",
                rank_pattern={r"layers/1/.*up_proj": 3}, alpha_pattern={"v_proj": 6},
                use_dora=True, modules_to_save=r"^lm_head/")
    adapters = lora.init(params)
    rs = np.random.RandomState(0)
    adapters = jax.tree_util.tree_map(
        lambda x: np.asarray(x) * rs.uniform(0.5, 1.5, np.shape(x)).astype(np.float32)
        + 0.1 * rs.standard_normal(np.shape(x)).astype(np.float32), adapters)
    ids = _ids(LLAMA["vocab_size"])
    ours = np.asarray(jax.jit(model.apply)(lora.merge(params, adapters), jnp.asarray(ids)))
    save_peft_adapters(model, lora, adapters, str(tmp_path / "ours"))
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), str(tmp_path / "ours")).eval()
    with torch.no_grad():
        theirs = _logits(loaded(torch.tensor(ids, dtype=torch.long)))
    print("redcoast's LoRA -> PEFT: max |logits difference|", np.abs(theirs - ours).max())
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == base  # the folder the model was read from
    assert written["rank_pattern"] == {r"model\.layers\.1\.mlp\.up_proj": 3}


@pytest.mark.slow  # ~6 s: a PEFT backward pass and a compiled gradient
def test_dora_gradients_equal_peft_s(tmp_path):
    """DoRA trains as PEFT trains it: the gradients of the same loss with respect to A, B, the
    magnitude and a trained bias equal those torch computes through PEFT's DoRA layers."""
    gpt2 = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                   n_head=4, bos_token_id=0, eos_token_id=0)
    base, model, params = _base_folder(tmp_path, transformers.GPT2LMHeadModel(gpt2))
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"],
                             use_dora=True, fan_in_fan_out=True, bias="lora_only")
    peft_model = _trained(peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(base), config), 7)
    peft_model.save_pretrained(str(tmp_path / "theirs"))
    ids = _ids(64)
    tokens = torch.tensor(ids, dtype=torch.long)
    out = peft_model(tokens, labels=tokens)
    out.loss.backward()
    grads = {n: p.grad.numpy() for n, p in peft_model.named_parameters() if p.requires_grad}

    lora, adapters = load_peft_adapters(str(tmp_path / "theirs"), model)

    def loss(adapters):
        logits = model.apply(lora.merge(params, adapters), jnp.asarray(ids))[:, :-1]
        labels = jnp.asarray(ids)[:, 1:]
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, labels[..., None], -1).mean()
    ours = jax.jit(jax.grad(loss))(adapters)
    layer = "base_model.model.transformer.h.1."
    c_attn = ours["h"]["1"]["attn"]["c_attn"]
    for name, got in ((f"{layer}attn.c_attn.lora_A.default.weight", c_attn["kernel"]["lora_a"].T),
                      (f"{layer}attn.c_attn.lora_B.default.weight",
                       c_attn["kernel"]["lora_b"].reshape(2, -1).T),
                      (f"{layer}attn.c_attn.lora_magnitude_vector.default.weight",
                       c_attn["kernel"]["lora_magnitude"].reshape(-1)),
                      (f"{layer}attn.c_attn.base_layer.bias", c_attn["bias"].reshape(-1)),
                      (f"{layer}mlp.c_fc.lora_magnitude_vector.default.weight",
                       ours["h"]["1"]["mlp"]["c_fc"]["kernel"]["lora_magnitude"])):
        want = grads[name]
        assert np.abs(want).max() > 1e-4, name
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, rtol=1e-4, err_msg=name)


@pytest.mark.slow  # ~8 s: a Llama, three PEFT models
def test_trained_embeddings_of_a_tied_model_load_when_peft_ties_them_too(tmp_path):
    """A tied model (one embedding in redcoast): PEFT's trained embedding copy feeds the output
    too only with ensure_weight_tying; without it PEFT keeps the original for the output, which
    redcoast cannot be, so that folder is refused."""
    tied = dict(LLAMA, tie_word_embeddings=True)
    base, model, params = _base_folder(
        tmp_path, transformers.LlamaForCausalLM(transformers.LlamaConfig(**tied)))
    config = peft.LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj"],
                             modules_to_save=["embed_tokens"], ensure_weight_tying=True)
    lora, adapters, written = _both_ways(tmp_path / "tying", base, model, params,
                                         transformers.AutoModelForCausalLM, config,
                                         [_ids(LLAMA["vocab_size"])])
    assert written["ensure_weight_tying"] and "embedding" in adapters["embed_tokens"]
    config = peft.LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj"],
                             modules_to_save=["embed_tokens"])
    peft_model = _trained(peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(base), config), 4)
    peft_model.save_pretrained(str(tmp_path / "untied"))
    with pytest.raises(ConfigError, match="ensure_weight_tying off: PEFT then uses the trained "
                       "copy for the input only"):
        load_peft_adapters(str(tmp_path / "untied"), model)
