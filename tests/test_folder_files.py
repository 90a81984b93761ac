"""A folder's files stay inside it (redcoast/store/folder_files.py): adapter and model folders whose
files link elsewhere on the machine are refused with the file and what named it; Hugging
Face's hub cache (snapshots linking into the repository's blobs) still loads."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from redcoast import ConfigError, LoRA, load_adapters, save_adapters
from redcoast.models import load_peft_adapters, save_peft_adapters
from test_lora import _model, _random_adapters


@pytest.fixture(scope="module")
def tiny():
    model, base = _model()
    lora = LoRA(rank=2, alpha=4)
    return model, base, lora, _random_adapters(lora, base)


def _linked(tmp_path, source, names, link, absolute=False):
    """A folder ``mine`` holding copies of ``source``'s files, except ``link`` (one of them): a
    symbolic link to ``source``'s, relative (``../``) or ``absolute``."""
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in names:
        if name != link:
            shutil.copy(source / name, mine / name)
        else:
            os.symlink(source / name if absolute else os.path.relpath(source / name, mine),
                       mine / name)
    return mine


@pytest.mark.parametrize("link, absolute", [("adapters.safetensors", False),
                                            ("lora_config.json", False),
                                            ("adapters.safetensors", True)])
def test_adapter_files_linking_outside_their_folder_are_refused(tiny, tmp_path, link, absolute):
    _, _, lora, adapters = tiny
    save_adapters(lora, adapters, str(tmp_path / "elsewhere"))
    mine = _linked(tmp_path, tmp_path / "elsewhere", ["adapters.safetensors", "lora_config.json"],
                   link, absolute)
    what = "weights" if "safetensors" in link else "config"
    with pytest.raises(ConfigError, match=f"the adapters' {what}") as caught:
        load_adapters(str(mine))  # before: loaded the other folder's file as its own
    assert f"{mine / link}" in str(caught.value) and "leads outside its folder" in str(caught.value)
    assert str(tmp_path / "elsewhere" / link) in str(caught.value)


@pytest.mark.parametrize("link", ["adapter_model.safetensors", "adapter_config.json"])
def test_peft_files_linking_outside_their_folder_are_refused(tiny, tmp_path, link):
    model, _, lora, adapters = tiny
    save_peft_adapters(model, lora, adapters, str(tmp_path / "elsewhere"))
    mine = _linked(tmp_path, tmp_path / "elsewhere",
                   ["adapter_model.safetensors", "adapter_config.json"], link)
    what = "weights" if "safetensors" in link else "config"
    with pytest.raises(ConfigError, match=f"the PEFT adapter's {what}") as caught:
        load_peft_adapters(str(mine), model)
    assert f"{mine / link}" in str(caught.value)


def test_links_inside_the_folder_and_the_hub_cache_layout_load(tiny, tmp_path):
    _, _, lora, adapters = tiny
    # huggingface_hub's cache: models--x/snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--someone--adapters"
    save_adapters(lora, adapters, str(repo / "blobs"))
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name in ("adapters.safetensors", "lora_config.json"):
        os.rename(repo / "blobs" / name, repo / "blobs" / f"hash-of-{name}")
        os.symlink(f"../../blobs/hash-of-{name}", snapshot / name)
    _, loaded = load_adapters(str(snapshot))
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, adapters)
    # a link to a file inside the folder itself
    inner = tmp_path / "inner"
    save_adapters(lora, adapters, str(inner / "real"))
    for name in ("adapters.safetensors", "lora_config.json"):
        os.symlink(f"real/{name}", inner / name)
    _, loaded = load_adapters(str(inner))
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, adapters)


def test_model_folder_extras_linking_outside_are_refused(tmp_path):
    from redcoast.models import from_pretrained, save_pretrained
    from redcoast.models.pretrained import read_generation_config

    (tmp_path / "secret.json").write_text(json.dumps({"eos_token_id": 5}))
    (tmp_path / "g").mkdir()
    os.symlink("../secret.json", tmp_path / "g" / "generation_config.json")
    with pytest.raises(ConfigError, match="the generation defaults") as caught:
        read_generation_config(str(tmp_path / "g"))  # before: {"eos_token_id": 5}
    assert str(tmp_path / "g" / "generation_config.json") in str(caught.value)

    model, params = _model()
    save_pretrained(model, params, str(tmp_path / "m"))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / f"outside-{name}").write_text("{}" if name.endswith(".json") else "{{ 1 }}")
        os.symlink(f"../outside-{name}", tmp_path / "m" / name)
        with pytest.raises(ConfigError, match="the chat template's source") as caught:
            from_pretrained(str(tmp_path / "m"))
        assert str(tmp_path / "m" / name) in str(caught.value)
        os.unlink(tmp_path / "m" / name)


def test_a_tokenizer_is_never_written_through_a_link_out_of_the_export_folder(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from redcoast.models.folder_extras import write_tokenizer

    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    (tmp_path / "out").mkdir()
    (tmp_path / "precious.txt").write_text("keep me")
    os.symlink("../precious.txt", tmp_path / "out" / "tokenizer.json")
    with pytest.raises(ConfigError, match="the tokenizer written"):
        write_tokenizer(str(tmp_path / "out"), tokenizer, model=None, config={})
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_a_config_or_index_linking_outside_the_folder_is_refused(tmp_path):
    from redcoast.models.hf import SafetensorsFolder, read_config

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "other" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {}}))
    (tmp_path / "m").mkdir()
    os.symlink("../other/config.json", tmp_path / "m" / "config.json")
    with pytest.raises(ConfigError, match=r"config.json \(the model's config\) leads outside"):
        read_config(str(tmp_path / "m"))  # before: the other model's config
    os.symlink("../other/model.safetensors.index.json",
               tmp_path / "m" / "model.safetensors.index.json")
    with pytest.raises(ConfigError, match=r"index.json \(the weights' index\) leads outside"):
        SafetensorsFolder(str(tmp_path / "m"))


def test_a_config_that_is_not_json_is_named(tmp_path):
    from redcoast.models.hf import read_config

    (tmp_path / "config.json").write_text('{"model_type": ')
    with pytest.raises(ConfigError, match=r"config.json cannot be read as JSON"):
        read_config(str(tmp_path))  # before: a JSONDecodeError naming no file
