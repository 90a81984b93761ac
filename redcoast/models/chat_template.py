"""A model's own chat template (Jinja), rendered as transformers renders it.

Hugging Face folders keep it in ``chat_template.jinja`` or ``tokenizer_config.json``
(``"chat_template"``), GGUF files in ``tokenizer.chat_template``. transformers renders it in a
sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the loop controls, a
``tojson`` filter that keeps non-ASCII text, ``raise_exception`` and ``strftime_now``, and the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables; so does
:class:`ChatTemplate`, so that a prompt is the one the model was trained on. Needs ``jinja2``
(``pip install 'redcoast[chat]'``).
"""

import dataclasses
import datetime
import json
import os

from ..errors import ConfigError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                  "mask_token")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it may refer to."""

    source: str
    special_tokens: tuple = ()   # ((name, text), ...), e.g. (("eos_token", "<|im_end|>"),)

    def render(self, messages, add_generation_prompt=True, tools=None, documents=None,
               **variables):
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...]); ``tools``
        (JSON schemas as dicts) and any other ``variables`` are passed to the template, as
        transformers' ``apply_chat_template(..., tokenize=False)`` passes them."""
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ConfigError("tools must be JSON schemas (dicts) of the functions, as "
                              "transformers' apply_chat_template takes them.")
        context = {**dict(self.special_tokens), **variables}
        return _compiled(self.source).render(messages=messages, tools=tools, documents=documents,
                                             add_generation_prompt=add_generation_prompt,
                                             **context)

    @classmethod
    def from_folder(cls, folder):
        """The folder's template (``chat_template.jinja``, else ``tokenizer_config.json``'s
        ``chat_template``, its "default" where it names several), or None where it has none."""
        config = {}
        path = os.path.join(folder, "tokenizer_config.json")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ConfigError(f"{path} cannot be read as JSON ({e}). Fix: repair it.") from None
        source = config.get("chat_template")
        jinja_file = os.path.join(folder, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file) as f:
                source = f.read()
        if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            return None
        tokens = {}
        for name in SPECIAL_TOKENS:
            value = config.get(name)
            if isinstance(value, dict):  # an AddedToken written out
                value = value.get("content")
            if isinstance(value, str):
                tokens[name] = value
        return cls(source, tuple(sorted(tokens.items())))

    @classmethod
    def from_gguf(cls, file):
        """The template of a :class:`redcoast.models.gguf.GGUFFile` (``tokenizer.chat_template``),
        with its BOS, EOS, unknown and padding tokens; None where the file has none."""
        source = file.get("tokenizer.chat_template")
        if not isinstance(source, str):
            return None
        vocabulary = file.get("tokenizer.ggml.tokens") or []
        tokens = {}
        for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                          ("pad_token", "padding")):
            index = file.get(f"tokenizer.ggml.{key}_token_id")
            if index is not None and 0 <= int(index) < len(vocabulary):
                tokens[name] = str(vocabulary[int(index)])
        return cls(source, tuple(sorted(tokens.items())))


_COMPILED = {}


def _compiled(source):
    if source not in _COMPILED:
        _COMPILED[source] = _environment().from_string(source)
    return _COMPILED[source]


def _environment():
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("Rendering a model's chat template needs jinja2. Fix: pip install "
                          "'redcoast[chat]' (or jinja2).") from None

    class GenerationBlocks(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks
        in transformers) rendered as its content."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_content"), [], [], body).set_lineno(lineno)

        @staticmethod
        def _content(caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env
