"""save_pretrained writes a folder transformers loads whole: the model (AutoModelForCausalLM), its
tokenizer (AutoTokenizer, with the chat template) and its generation defaults (GenerationConfig),
and transformers' generate on it gives redcoast's tokens."""

import json

import jax
import numpy as np
import pytest

from redcoast.errors import ConfigError
from redcoast.models import Model, llama, save_pretrained
from redcoast.models.chat_template import ChatTemplate
from redcoast.models.generate import generate

WORDS = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(28)]
TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }} {{ m['content'] }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}{{ bos_token }}assistant{% endif %}")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    model = Model(llama.LlamaForCausalLM, llama.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=3))
    model.chat_template = ChatTemplate(TEMPLATE, (("bos_token", "<s>"), ("eos_token", "</s>")))
    params = model.init(0)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>", "<pad>"])
    folder = tmp_path_factory.mktemp("exported")
    save_pretrained(model, params, folder, tokenizer=tokenizer,
                    generation_config={"max_length": 40})
    return model, params, tokenizer, folder


def test_the_folder_names_its_dtype_generation_defaults_and_tokenizer(exported):
    model, params, tokenizer, folder = exported
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    assert json.loads((folder / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "max_length": 40}
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "</s>" and tokenizer_config["pad_token"] == "<pad>"
    assert tokenizer_config["chat_template"] == TEMPLATE
    with pytest.raises(ConfigError, match="a transformers tokenizer or a tokenizers.Tokenizer"):
        save_pretrained(model, params, folder / "again", tokenizer="w0 w1")


def test_transformers_loads_tokenizer_and_generation_config_and_generates_the_same(exported):
    transformers = pytest.importorskip("transformers")
    model, params, tokenizer, folder = exported
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "w4 w5 w6"}]
    text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == model.chat_template.render(messages)
    assert theirs(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text).ids
    assert theirs.eos_token_id == 2 and theirs.pad_token_id == 3
    defaults = transformers.GenerationConfig.from_pretrained(folder)
    assert (defaults.eos_token_id, defaults.pad_token_id, defaults.max_length) == (2, 3, 40)

    torch = pytest.importorskip("torch")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = np.asarray([tokenizer.encode(text).ids], np.int32)
    with torch.no_grad():  # transformers' defaults come from the folder, as redcoast's do
        expected = reference.generate(torch.tensor(prompt, dtype=torch.long), do_sample=False,
                                      max_new_tokens=12)[0, prompt.shape[1]:].numpy()
    ours = np.asarray(generate(model, jax.device_get(params), prompt, max_new_tokens=12))[0]
    assert (ours[:len(expected)] == expected).all(), (ours, expected)
    assert (ours[len(expected):] == 3).all()  # after EOS: the pad token
