"""A PEFT folder is the model PEFT builds from it: the modules adapter_config.json's
target_modules adapts, by PEFT's own matching rules (checked against the installed peft), and a
folder whose weights hold other modules is refused naming the tensors (issue 48, case 7)."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from redcoast import ConfigError, LoRA
from redcoast.models import Model, llama, load_peft_adapters, save_peft_adapters
from redcoast.models.peft import _module_kinds
from redcoast.models.peft_targets import targeted
from test_lora import TINY, _model, _random_adapters

CONFIGS = [
    {"target_modules": ["q_proj", "v_proj"]},
    {"target_modules": ["model.layers.1.mlp.up_proj", "o_proj"]},
    {"target_modules": ["self_attn.k_proj", "proj"]},  # "proj" is no name's last part
    {"target_modules": r".*\.0\.self_attn\.(q|k)_proj"},
    {"target_modules": "q_proj"},  # a string is a whole-name regex: matches nothing
    {"target_modules": ".*_proj"},
    {"target_modules": "all-linear"},
    {"target_modules": "ALL-LINEAR", "exclude_modules": ["down_proj", "model.layers.0.mlp.up_proj"]},
    {"target_modules": ".*proj", "exclude_modules": r".*\.1\..*"},
    {"target_modules": ["q_proj", "up_proj"], "layers_to_transform": [1]},
    {"target_modules": ["q_proj", "model.layers.0.mlp.up_proj"], "layers_to_transform": 1,
     "layers_pattern": "layers"},
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: json.dumps(c)[:60])
def test_the_modules_a_config_adapts_are_those_peft_adapts(config):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    try:
        peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=2, **config))
        theirs = sorted({n.split(".lora_A")[0][len("base_model.model."):]
                         for n, _ in peft_model.named_parameters() if ".lora_A" in n})
    except ValueError as e:  # PEFT refuses a config that adapts nothing
        assert "not found in the base model" in str(e) or "No modules were targeted" in str(e)
        theirs = []
    model = Model(llama.MODULES["LlamaForCausalLM"], llama.Config(**TINY))
    assert sorted(targeted(config, _module_kinds(model))) == theirs


def _folder(tmp_path, edit):
    """A PEFT folder of q_proj and v_proj adapters whose adapter_config.json is then edited."""
    model, base = _model()
    lora = LoRA(rank=2, alpha=4, targets=r"(q_proj|v_proj)/kernel$")
    adapters = _random_adapters(lora, base)
    folder = tmp_path / "adapters"
    save_peft_adapters(model, lora, adapters, str(folder))
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"]
    config.update(edit)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return model, base, lora, adapters, folder


@pytest.mark.parametrize("edit, said", [
    ({"target_modules": ["q_proj"]}, "holds adapters of 2 modules that target_modules=['q_proj'] "
     "does not adapt (PEFT leaves them unread): base_model.model.model.layers.0.self_attn.v_proj"),
    ({"target_modules": ["q_proj", "v_proj", "k_proj"]}, "adapts 2 modules whose adapters "
     "{weights} lacks (PEFT keeps them as initialised): "
     "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"),
    ({"target_modules": "v_proj"}, "does not adapt"),  # a regex of the whole name
    ({"target_modules": "all-linear"}, "lacks"),
    ({"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [0]},
     "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"),
    ({"target_modules": ["q_proj", "v_proj"], "exclude_modules": ["v_proj"]}, "does not adapt"),
    ({"target_modules": None}, "target_modules=None: PEFT would take its own default"),
])
def test_a_folder_whose_target_modules_disagree_with_its_weights_is_refused(tmp_path, edit, said):
    model, _, _, _, folder = _folder(tmp_path, edit)
    said = said.format(weights=folder / "adapter_model.safetensors")
    with pytest.raises(ConfigError) as caught:
        load_peft_adapters(str(folder), model)  # before: loaded from the weights alone
    assert said in str(caught.value) and str(folder / "adapter_config.json") in str(caught.value)
    assert "Fix:" in str(caught.value)


@pytest.mark.parametrize("edit", [
    {"target_modules": [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qv"]},
    {"target_modules": r"model\.layers\.\d+\.self_attn\.(q|v)_proj"},
    {"target_modules": ["q_proj", "v_proj", "gate_proj"], "exclude_modules": ["gate_proj"]},
])
def test_other_spellings_of_the_same_modules_load(tmp_path, edit):
    model, base, lora, adapters, folder = _folder(tmp_path, edit)
    lora2, loaded = load_peft_adapters(str(folder), model)
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, adapters)


def test_peft_builds_an_edited_folder_from_target_modules(tmp_path):
    """What the refusal is about: PEFT itself takes target_modules, not the weights (it drops
    the v_proj adapters without a word), so the folder is two models."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    _, _, _, _, folder = _folder(tmp_path, {"target_modules": ["q_proj"]})
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    peft_model = peft.PeftModel.from_pretrained(hf, str(folder))
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1]
               for n, _ in peft_model.named_parameters() if ".lora_A" in n}
    assert adapted == {"q_proj"}


@pytest.mark.slow  # a transformers model, a PEFT model and two compilations: ~10 s
def test_peft_s_regex_and_all_linear_folders_load_as_peft_loads_them(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from hf_reference import randomize
    from redcoast.models import from_pretrained

    randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))).save_pretrained(
        str(tmp_path / "base"))
    model, base = from_pretrained(str(tmp_path / "base"))
    ids = np.stack([(s + np.arange(12)) % TINY["vocab_size"] for s in (3, 17, 40)])
    for i, target in enumerate([r".*\.1\.mlp\.(up|down)_proj", "all-linear"]):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).eval()
        peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=3,
                                                             target_modules=target))
        torch.manual_seed(i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.2)
        folder = tmp_path / f"theirs-{i}"
        peft_model.save_pretrained(str(folder))
        with torch.no_grad():
            theirs = peft_model.eval()(torch.tensor(ids)).logits.float().numpy()
        lora, loaded = load_peft_adapters(str(folder), model)
        ours = np.asarray(jax.jit(model.apply)(lora.merge(base, loaded), jnp.asarray(ids)))
        np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)


def test_config_files_that_are_no_settings_are_named(tmp_path):
    from redcoast import load_adapters, save_adapters

    model, _, lora, adapters, folder = _folder(tmp_path, {})
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="adapter_config.json cannot be read as JSON"):
        load_peft_adapters(str(folder), model)
    for edit, said in (({"r": "2"}, "r='2'; the rank is a positive integer"),
                       ({"lora_alpha": None}, "lora_alpha=None; it is a number"),
                       ({"target_modules": "embed_tokens"}, "adapts no linear layer")):
        _, _, _, _, folder = _folder(tmp_path / str(len(said)), edit)
        if "adapts no" in said:  # and weights that hold nothing either
            from safetensors.numpy import save_file
            save_file({}, str(folder / "adapter_model.safetensors"))
        with pytest.raises(ConfigError, match=re.escape(said)):
            load_peft_adapters(str(folder), model)
    # left out, lora_alpha is PEFT's default (8), as LoraConfig reads the file
    _, _, _, _, folder = _folder(tmp_path / "alpha", {})
    config = json.loads((folder / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    assert load_peft_adapters(str(folder), model)[0].scale == 8 / 2

    save_adapters(lora, adapters, str(tmp_path / "ours"))
    config = json.loads((tmp_path / "ours" / "lora_config.json").read_text())
    del config["kernels"]
    (tmp_path / "ours" / "lora_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=re.escape("lora_config.json lacks ['kernels']")):
        load_adapters(str(tmp_path / "ours"))  # before: KeyError: 'kernels'
    (tmp_path / "ours" / "lora_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a JSON list, not an object"):
        load_adapters(str(tmp_path / "ours"))


@pytest.mark.parametrize("edit, said", [
    ({"init_lora_weights": "pissa_niter_4"}, "the base weights were changed too"),
    ({"init_lora_weights": "loftq"}, "the base weights were changed too"),
    ({"alora_invocation_tokens": [5, 6]}, "Activated LoRA"),
    ({"layer_replication": [[0, 2], [1, 2]]}, "layers repeated"),
    ({"lora_bias": True}, "a bias on lora_B"),
    ({"use_dora": True}, "without ['lora_magnitude_vector']"),
    ({"rank_pattern": {"q_proj": 0}}, "rank_pattern['q_proj']=0; it is a positive integer"),
    ({"rank_pattern": {"q_proj": 3}}, "not (r=3, 32)"),  # the weights hold rank 2
    ({"bias": "some"}, "bias='some'"),
])
def test_peft_options_redcoast_cannot_build_are_refused_naming_them(tmp_path, edit, said):
    """Options found in the wild whose model the weights alone do not make (issue 50)."""
    model, _, _, _, folder = _folder(tmp_path, edit)
    with pytest.raises(ConfigError) as caught:
        load_peft_adapters(str(folder), model)
    assert said in str(caught.value) and "Fix:" in str(caught.value)


def test_whole_tensors_the_config_does_not_train_are_refused(tmp_path):
    """A trained norm weight in a folder whose config trains no whole module: PEFT would load
    it into the base, a model adapter_config.json does not describe."""
    from safetensors.numpy import load_file, save_file

    model, base, lora, adapters, folder = _folder(tmp_path, {})
    weights = str(folder / "adapter_model.safetensors")
    tensors = load_file(weights)
    tensors["base_model.model.model.norm.weight"] = np.ones(32, np.float32)
    save_file(tensors, weights)
    with pytest.raises(ConfigError, match=r"holds \['model.norm.weight'\], which .* does not "
                       r"train \(bias='none', modules_to_save=None\)"):
        load_peft_adapters(str(folder), model)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["modules_to_save"] = ["norm"]  # PEFT's endswith rule: "model.norm" ends with "norm"
    (folder / "adapter_config.json").write_text(json.dumps(config))
    lora2, loaded = load_peft_adapters(str(folder), model)
    np.testing.assert_array_equal(loaded["norm"]["scale"], np.ones(32))
    merged = lora2.merge(base, loaded)
    np.testing.assert_array_equal(merged["norm"]["scale"], np.ones(32))
