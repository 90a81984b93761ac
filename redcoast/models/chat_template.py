"""A model's own chat template (Jinja), rendered as transformers renders it.

Hugging Face folders keep it in ``chat_template.jinja`` or ``tokenizer_config.json``
(``"chat_template"``), GGUF files in ``tokenizer.chat_template``. transformers renders it in a
sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the loop controls, a
``tojson`` filter that keeps non-ASCII text, ``raise_exception`` and ``strftime_now``, and the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables; so does
:class:`ChatTemplate`, so that a prompt is the one the model was trained on. Needs ``jinja2``
(``pip install 'redcoast[chat]'``).

A template comes with the model's files and runs as code, so unlike transformers, redcoast
renders it under a :class:`~redcoast.models.template_budget.TemplateBudget` (steps, seconds,
characters; :mod:`redcoast.models.template_sandbox` says where it is metered): one that loops or
grows without end stops with a :class:`~redcoast.errors.ConfigError` naming its file and the
limit to raise (``template.with_budget(TemplateBudget(...))``) for those who trust it.
"""

import dataclasses
import datetime
import functools
import json
import os

from ..errors import ConfigError
from .template_budget import BudgetMeter, TemplateBudget

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                  "mask_token")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template, the special tokens it may refer to, where it was read from (for
    errors) and what one rendering of it may use (``budget``; None: no limit)."""

    source: str
    special_tokens: tuple = ()   # ((name, text), ...), e.g. (("eos_token", "<|im_end|>"),)
    origin: str | None = dataclasses.field(default=None, compare=False)   # its file, if known
    budget: TemplateBudget | None = TemplateBudget()

    def with_budget(self, budget):
        """This template with another :class:`TemplateBudget` (None: no limit)."""
        return dataclasses.replace(self, budget=budget)

    def render(self, messages, add_generation_prompt=True, tools=None, documents=None,
               **variables):
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...]); ``tools``
        (JSON schemas as dicts) and any other ``variables`` are passed to the template, as
        transformers' ``apply_chat_template(..., tokenize=False)`` passes them. A template that
        goes over ``budget`` stops with a :class:`~redcoast.errors.ConfigError` saying which limit
        to raise (``with_budget``)."""
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ConfigError("tools must be JSON schemas (dicts) of the functions, as "
                              "transformers' apply_chat_template takes them.")
        template = _compiled_template(self.source)   # first: it says how to install jinja2 where missing
        from .template_sandbox import render

        meter = BudgetMeter(self.budget or TemplateBudget.unlimited(), self.origin)
        context = {**dict(self.special_tokens), **variables, "messages": messages, "tools": tools,
                   "documents": documents, "add_generation_prompt": add_generation_prompt}
        return render(template, context, meter)

    @classmethod
    def from_folder(cls, folder, budget=TemplateBudget()):
        """The folder's template (``chat_template.jinja``, else ``tokenizer_config.json``'s
        ``chat_template``, its "default" where it names several), or None where it has none;
        ``budget``: what one rendering may use (None: no limit)."""
        config = {}
        path = os.path.join(folder, "tokenizer_config.json")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ConfigError(f"{path} cannot be read as JSON ({e}). Fix: repair it.") from None
        source, origin = config.get("chat_template"), path
        jinja_file = os.path.join(folder, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file) as f:
                source, origin = f.read(), jinja_file
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
        return cls(source, tuple(sorted(tokens.items())), origin, budget)

    @classmethod
    def from_gguf(cls, file, budget=TemplateBudget()):
        """The template of a :class:`redcoast.models.gguf.GGUFFile` (``tokenizer.chat_template``),
        with its BOS, EOS, unknown and padding tokens; None where the file has none;
        ``budget``: what one rendering may use (None: no limit)."""
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
        origin = getattr(file, "path", None)
        return cls(source, tuple(sorted(tokens.items())),
                   None if origin is None else f"{origin} (tokenizer.chat_template)", budget)


@functools.lru_cache(maxsize=32)
def _compiled_template(source):
    return _environment().from_string(source)


def _environment():
    try:
        import jinja2
        import jinja2.ext

        from .template_sandbox import BudgetedEnvironment
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

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env
