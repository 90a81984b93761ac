"""The Jinja environment chat templates render in: Jinja's immutable sandbox, as in transformers,
with every step a template takes metered by the rendering's
:class:`~redcoast.models.template_budget.BudgetMeter`.

Where it meters: each loop iteration (the loop's iterable is wrapped when the template is
parsed, recursive ``loop(...)`` calls too), call, filter (and each item a filter goes through),
test and arithmetic operator is a step; every output (``{{ }}`` and literal text, inside macros
and ``{% set %}`` blocks too) and every text or list an operator, ``~``, filter or method makes
is counted before (where its arguments can make it large: ``*``, ``+``, ``%``, ``center``,
``indent``, ``replace``, ``join``, ``format``, ``ljust``, ...) or just after it is made; values
that a comparison, hash, sort or ``str`` would go through are measured first (a list that holds
the same big list a million times is small in memory and endless to compare or print).
``lipsum``, ``cycler`` and ``joiner`` are gone, as are the ``pprint``, ``urlize`` and
``wordwrap`` filters (debug and HTML tools no chat template needs, whose output their arguments
can make endless). The meter reaches the template's code as a context variable whose name
has a space, which no template can write.
"""

import itertools
import json
import types

from jinja2 import nodes, pass_context
from jinja2.exceptions import SecurityError
from jinja2.filters import make_attrgetter
from jinja2.runtime import LoopContext, Macro, markup_join, missing, str_join
from jinja2.sandbox import (ImmutableSandboxedEnvironment, SandboxedEscapeFormatter,
                            SandboxedFormatter)
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

from ..errors import ConfigError
from .template_budget import (format_spec_size, method_size, operator_size, percent_size,
                              replaced_size, text_size)

METER = "redcoast budget meter"   # a variable no template can name
MACRO_STEPS = 10   # a macro call costs Jinja about as much as ten loop iterations
ITERATE, TEXT, JOIN, GUARD = "redcoast iterate", "redcoast text", "redcoast join", "redcoast guard"

REFUSED_GLOBALS = ("lipsum", "cycler", "joiner")
REFUSED_FILTERS = ("pprint", "urlize", "wordwrap")
# filters that go through their input (a step per item)
ITERATING = {"map", "select", "reject", "selectattr", "rejectattr", "unique", "min", "max", "sort",
             "dictsort", "groupby", "batch", "slice", "list", "reverse", "items", "xmlattr"}
# filters that compare, hash or write out their whole input
MEASURING = {"unique", "min", "max", "sort", "dictsort", "groupby", "capitalize", "center",
             "escape", "e", "forceescape", "format", "indent", "lower", "replace", "safe",
             "string", "striptags", "title", "trim", "truncate", "upper", "urlencode",
             "wordcount", "xmlattr"}
# filters that return (part of) their input rather than something new
SELECTING = {"first", "last", "default", "d", "attr", "random", "min", "max", "reverse"}


def meter_of(context):
    """The rendering's meter (rendering without one is refused)."""
    meter = context.resolve_or_missing(METER)
    if meter is missing:
        raise SecurityError("A chat template ran without its budget meter. Fix: render it with "
                            "redcoast.models.template_sandbox.render.")
    return meter


def render(template, variables, meter):
    """``template`` (compiled by a :class:`BudgetedEnvironment`) rendered with ``variables``,
    each piece of the prompt counted as it comes."""
    context = template.new_context({**variables, METER: meter})
    pieces = []
    try:
        for piece in template.root_render_func(context):
            meter.emit(len(piece))
            pieces.append(piece)
    except Exception:
        template.environment.handle_exception()
    return "".join(pieces)


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, metered (see the module's docstring)."""

    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])

    def __init__(self, **options):
        super().__init__(**options)
        self.finalize = _finalize
        for name in REFUSED_GLOBALS:
            self.globals[name] = _refusal(f"the global {name}()")
        self.globals["dict"] = TemplateDict()
        self.globals["namespace"] = TemplateNamespace
        self._meter_filters()

    def _meter_filters(self):
        own = {"join": _join, "sum": _sum, "tojson": _tojson}
        self.filters = {name: _metered_filter(name, own.get(name), function)
                        for name, function in self.filters.items()}
        for name in REFUSED_FILTERS:
            self.filters[name] = _refusal(f"the filter {name}")
        self.filters.update({ITERATE: _iterate, TEXT: _text, JOIN: _concat, GUARD: _guard})
        self.tests = {name: _metered_test(function) for name, function in self.tests.items()}

    def compile(self, source, name=None, filename=None, raw=False, defer_init=False):
        """Jinja's compile, with every template's tree metered first (every way to a template,
        ``from_string`` included, compiles through here)."""
        tree = self.parse(source, name, filename) if isinstance(source, str) else source
        tree = _Metering().visit(tree)
        tree.set_environment(self)
        return super().compile(tree, name, filename, raw=raw, defer_init=defer_init)

    def is_safe_attribute(self, obj, attr, value):
        # a metered str.format is the sandbox's own machinery: nothing on it is a template's
        return not isinstance(obj, MeteredStrFormat) and super().is_safe_attribute(
            obj, attr, value)

    def call_binop(self, context, operator, left, right):
        meter = meter_of(context)
        meter.step()
        operator_size(meter, operator, left, right)
        result = self.binop_table[operator](left, right)
        if operator == "%":
            meter.charge(result)
        return result

    def wrap_str_format(self, value):
        if (isinstance(value, (types.MethodType, types.BuiltinMethodType))
                and value.__name__ in ("format", "format_map") and isinstance(value.__self__, str)):
            return MeteredStrFormat(self, value.__self__, value.__name__ == "format_map")
        return None

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        meter = meter_of(__context)
        meter.step(MACRO_STEPS if isinstance(__obj, Macro) else 1)
        __obj = __self.wrap_str_format(__obj) or __obj   # jinja2 < 3.1.5 hands the method itself
        if isinstance(__obj, MeteredStrFormat):
            return __obj.run(meter, args, kwargs)
        if isinstance(__obj, LoopContext) and args:   # loop(children) in a recursive loop
            args = (meter.iterate(args[0]),) + args[1:]
        owner = getattr(__obj, "__self__", None)
        for value in (*args, *kwargs.values(), owner):
            meter.check_value(value, "an argument")
        if isinstance(owner, (str, bytes, int)):
            method_size(meter, __obj, args, kwargs)
            if __obj.__name__ == "join" and len(args) == 1:
                args = (_joined_items(meter, args[0], len(owner), strings=True),)
        result = super().call(__context, __obj, *args, **kwargs)
        if getattr(__obj, "__name__", "") not in ("get", "cycle"):   # those return what exists
            meter.charge(result)
        return result


class TemplateDict:
    """``dict`` for templates: calling it and ``fromkeys``, not the type (as transformers)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(Namespace):
    """``namespace`` for templates, with no underscore-prefixed attribute (as transformers)."""

    def __init__(*args, **kwargs):   # noqa: N805 (Namespace's signature: namespace(self=...) works)
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _check_namespace_name(name)
        Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _check_namespace_name(name)
        Namespace.__setitem__(self, name, value)


def _check_namespace_name(name):
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"A chat template may not store the underscore-prefixed attribute "
                            f"{name!r} on a namespace. Fix: rename it in the template.")


class _Metering(NodeTransformer):
    """Rewrites a parsed template so that its loops, literal text, ``~`` joins, comparisons and
    keys reach the meter (through filters no template can name)."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = _filter(node.iter, ITERATE)
        return node

    def visit_Output(self, node):
        self.generic_visit(node)
        node.nodes = [_filter(child, TEXT) if isinstance(child, nodes.TemplateData) else child
                      for child in node.nodes]
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return _filter(nodes.Tuple(node.nodes, "load", lineno=node.lineno), JOIN)

    def visit_Compare(self, node):
        self.generic_visit(node)
        node.expr = _guarded(node.expr)
        for operand in node.ops:
            operand.expr = _guarded(operand.expr)
        return node

    def visit_Pair(self, node):
        self.generic_visit(node)
        node.key = _guarded(node.key)
        return node

    def visit_Getitem(self, node):
        self.generic_visit(node)
        if not isinstance(node.arg, nodes.Slice):
            node.arg = _guarded(node.arg)
        return node


def _filter(node, name):
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


def _guarded(node):
    return node if isinstance(node, nodes.Const) else _filter(node, GUARD)


@pass_context
def _iterate(context, values):
    return meter_of(context).iterate(values)


@pass_context
def _text(context, text):
    return text   # not a constant, so that _finalize counts it


@pass_context
def _guard(context, value):
    meter_of(context).check_value(value, "a value to compare or look up")
    return value


@pass_context
def _finalize(context, value):
    meter = meter_of(context)
    if isinstance(value, str):
        meter.build(len(value), "an output")
    else:
        meter.check_value(value, "an output")
        meter.build(text_size(value, meter.limit), "an output")
    return value


@pass_context
def _concat(context, values):
    meter = meter_of(context)
    meter.step()
    size = 0
    for value in values:
        meter.check_value(value, "a value joined with ~")
        size += len(value) if isinstance(value, str) else text_size(value, meter.limit)
    meter.build(size, "a text joined with ~")
    return (markup_join if context.eval_ctx.autoescape else str_join)(values)


def _refusal(what):
    def refuse(*args, **kwargs):
        raise ConfigError(f"A chat template used {what}, which redcoast does not offer chat "
                          "templates (its output can be made endless, and no real template "
                          "needs it). Fix: edit the template to do without it.")
    return refuse


def _call_with(function, context, args, kwargs):
    """``function`` called as Jinja calls a filter or test: with what it asks to be passed."""
    passed = getattr(function, "jinja_pass_arg", None)
    passed = getattr(passed, "name", None)
    if passed == "context":
        return function(context, *args, **kwargs)
    if passed == "eval_context":
        return function(context.eval_ctx, *args, **kwargs)
    if passed == "environment":
        return function(context.environment, *args, **kwargs)
    return function(*args, **kwargs)


def _metered_filter(name, own, function):
    """The filter ``function`` metered: a step, a step per item it goes through, its input
    measured where it compares or writes it out, its argument-driven growth checked first
    (``own``: redcoast's bounded version instead), what it makes counted."""
    guard = _GUARDS.get(name)

    @pass_context
    def metered(context, *args, **kwargs):
        meter = meter_of(context)
        meter.step()
        if args and name in ITERATING:
            args = (meter.iterate(args[0]),) + args[1:]
        if args and name in MEASURING:
            meter.check_value(args[0], f"the input of the filter {name}")
        if guard is not None:
            guard(meter, *args, **kwargs)
        if own is not None:
            result = own(meter, context, function, *args, **kwargs)
        else:
            result = _call_with(function, context, args, kwargs)
        if name not in SELECTING:
            meter.charge(result)
        return result

    metered.__name__ = f"metered_{name}"
    return metered


def _metered_test(function):
    @pass_context
    def metered(context, *args, **kwargs):
        meter = meter_of(context)
        meter.step()
        for value in (*args, *kwargs.values()):
            meter.check_value(value, "a tested value")
        return _call_with(function, context, args, kwargs)
    return metered


def _center_guard(meter, value, width=80, *args, **kwargs):
    if isinstance(width, int):
        meter.check(max(len(str(value)), width), "a text from the filter center")


def _indent_guard(meter, text, width=4, *args, **kwargs):
    unit = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    text = str(text)
    meter.check(len(text) + (text.count("\n") + 1) * unit, "a text from the filter indent")


def _replace_guard(meter, text, old, new, count=None, *args, **kwargs):
    for value in (old, new):
        meter.check_value(value, "an argument of the filter replace")
    size = replaced_size(str(text), str(old), str(new), -1 if count is None else count)
    meter.check(size, "a text from the filter replace")


def _format_guard(meter, text, *args, **kwargs):
    meter.check(percent_size(str(text), kwargs or args, meter.limit),
                "a text from the filter format")


def _count_guard(what):
    def guard(meter, values, count=1, *args, **kwargs):
        if isinstance(count, int):
            meter.check(count, f"a list from the filter {what}")
    return guard


_GUARDS = {"center": _center_guard, "indent": _indent_guard, "replace": _replace_guard,
           "format": _format_guard, "batch": _count_guard("batch"),
           "slice": _count_guard("slice")}


def _joined_items(meter, values, separator_size, strings=False):
    """``values`` as a list, a step per item, refused as soon as they (as text) and the
    separators between them would pass the meter's limit."""
    items, size = [], 0
    for value in meter.iterate(values):
        if strings and isinstance(value, (str, bytes)):
            size += len(value) + separator_size
        else:
            size += text_size(value, meter.limit) + separator_size
        meter.check(size, "a joined text")
        items.append(value)
    return items


def _join(meter, context, join, values, d="", attribute=None):
    """Jinja's ``join``, over items counted and measured as they come."""
    if attribute is not None:
        values = map(make_attrgetter(context.environment, attribute), values)
    meter.check_value(d, "a join separator")
    items = _joined_items(meter, values, text_size(d, meter.limit))
    return _call_with(join, context, (items, d), {})


def _sum(meter, context, _, values, attribute=None, start=0):
    """Jinja's ``sum``; lists and tuples chained (once) rather than added (each time anew)."""
    if attribute is not None:
        values = map(make_attrgetter(context.environment, attribute), values)
    items = list(meter.iterate(values))
    if isinstance(start, (list, tuple)) and all(type(item) is type(start) for item in items):
        meter.build(len(start) + sum(len(item) for item in items), "a list from the filter sum")
        return type(start)(itertools.chain(start, *items))
    return sum(items, start)


def _tojson(meter, context, _, value, ensure_ascii=False, indent=None, separators=None,
            sort_keys=False):
    """transformers' ``tojson`` (``json.dumps``, non-ASCII kept), written piece by piece and
    stopped where it passes the meter's limit."""
    width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    meter.check(width * 1000, "JSON indentation")   # each line: at most ~1000 levels deep
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    pieces, size = [], 0
    for piece in encoder.iterencode(value):
        size += len(piece)
        meter.check(size, "JSON text")
        pieces.append(piece)
    return "".join(pieces)


class MeteredStrFormat:
    """What a template gets for ``text.format`` / ``text.format_map``: Jinja's sandboxed
    formatting, each field measured before it is written."""

    def __init__(self, environment, text, is_format_map):
        self._environment, self._text, self._is_format_map = environment, text, is_format_map

    def __call__(self, *args, **kwargs):
        raise SecurityError("str.format reached outside a template's own calls.")

    def run(self, meter, args, kwargs):   # out of a template's reach: is_safe_attribute
        if self._is_format_map:
            if kwargs or len(args) != 1:
                raise TypeError("format_map() takes exactly one argument")
            args, kwargs = (), args[0]
        if isinstance(self._text, Markup):
            formatter = _MeteredEscapeFormatter(self._environment, meter, escape=self._text.escape)
        else:
            formatter = _MeteredFormatter(self._environment, meter)
        result = type(self._text)(formatter.vformat(self._text, args, kwargs))
        meter.build(len(result), "a formatted text")
        return result


class _MeteredFormatter(SandboxedFormatter):
    def __init__(self, environment, meter, **options):
        super().__init__(environment, **options)
        self._meter, self._size = meter, 0

    def convert_field(self, value, conversion):
        if conversion is not None:
            self._meter.check_value(value, "a formatted field")
        return super().convert_field(value, conversion)

    def format_field(self, value, format_spec):
        limit = self._meter.limit
        self._meter.check(text_size(value, limit) + format_spec_size(format_spec, limit),
                          "a formatted field")
        text = super().format_field(value, format_spec)
        self._size += len(text)
        self._meter.check(self._size, "a formatted text")
        return text


class _MeteredEscapeFormatter(_MeteredFormatter, SandboxedEscapeFormatter):
    pass
