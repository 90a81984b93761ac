"""How much one rendering of a chat template may do: steps, seconds and characters.

A model's chat template is code that comes with its files (``tokenizer_config.json``, a GGUF
file's metadata); Jinja's sandbox keeps it from reaching Python, not from running without end:
two nested ``range(100000)`` loops, ``'a' * 10**10`` or a text doubled in a loop take any CPU and
memory. :class:`BudgetMeter` counts what a rendering does (see
:mod:`redcoast.models.template_sandbox` for where) against a :class:`TemplateBudget` and raises
:class:`~redcoast.errors.ConfigError` where it would go over, before building what would not fit.
"""

import dataclasses
import math
import re
import time

from ..errors import ConfigError

#: integers past this many bits are refused (a prompt has no use for them; Python cannot even
#: print one past 4300 digits, and multiplying them takes ever longer)
MAX_INT_BITS = 1 << 16


@dataclasses.dataclass(frozen=True)
class TemplateBudget:
    """What one rendering of a chat template may use; None lifts that limit.

    ``max_steps``: loop iterations, calls (a macro call ten), filters (and each item they go
    through), tests and operators. ``max_seconds``: wall-clock time, looked at on every step (it
    stops what the steps undercount: one step over a list of millions). ``max_output_chars``:
    the prompt, and any one text or list the template makes on the way (a list counts its items,
    a value to print, compare or hash what ``repr`` would write of it). ``max_built_chars``: all
    the texts and lists it makes, added up (bounding what it can hold in memory). The defaults
    stop a hostile template within about a second; real ones (Llama 3.1, Qwen2.5/3, Mistral,
    Gemma, SmolLM2) take about a dozen steps per message and build at most four characters per
    character of prompt, so a 4-million-character prompt (about a million tokens) renders.
    """

    max_steps: int | None = 250_000
    max_seconds: float | None = 10.0
    max_output_chars: int | None = 4_000_000
    max_built_chars: int | None = 32_000_000

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value > 0):
                raise ConfigError(f"TemplateBudget({field.name}={value!r}): each limit is a "
                                  "positive number, or None for no limit. Fix: pass one.")

    @classmethod
    def unlimited(cls):
        """No limit at all: for templates you wrote or trust."""
        return cls(None, None, None, None)


class BudgetMeter:
    """One rendering's use of a :class:`TemplateBudget`; ``origin`` (the template's file, if
    known) goes into the error that stops it."""

    def __init__(self, budget, origin=None, clock=time.monotonic):
        self.budget = budget
        self.origin = origin
        self.steps = self.built = self.output = 0
        self._clock = clock
        self._deadline = None if budget.max_seconds is None else clock() + budget.max_seconds
        self._max_steps = _or_inf(budget.max_steps)
        self.limit = _or_inf(budget.max_output_chars)   # of the prompt and of any one object
        self._max_built = _or_inf(budget.max_built_chars)

    def step(self, count=1):
        """``count`` more steps (and a look at the clock)."""
        self.steps += count
        if self.steps > self._max_steps:
            raise self.exceeded("max_steps", f"it ran more than {self._max_steps:,} steps (loop "
                                 "iterations, calls, filters, tests, operators)")
        if self._deadline is not None and self._clock() > self._deadline:
            raise self.exceeded("max_seconds", f"it ran longer than {self.budget.max_seconds} s")

    def check(self, size, what):
        """Refuses to make ``what``, of ``size`` characters or items, where that is over
        ``max_output_chars``."""
        if size > self.limit:
            raise self.exceeded("max_output_chars", f"it would make {what} of "
                                 f"{_readable_count(size)} characters or items, over {self.limit:,}")

    def build(self, size, what="a text or list"):
        """Before (or just after) the template makes an object of ``size`` characters or items."""
        self.check(size, what)
        self.built += size
        if self.built > self._max_built:
            raise self.exceeded("max_built_chars", "the texts and lists it made add up to more "
                                 f"than {self._max_built:,} characters or items")

    def charge(self, value):
        """:meth:`build` for a value just made, if it is a text or a container."""
        if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
            self.build(len(value))

    def check_value(self, value, what="a value"):
        """Refuses a value whose text (or whose comparison, hash, sort or JSON, which go through
        no more) would be over ``max_output_chars`` (see :func:`text_size`)."""
        if isinstance(value, _CONTAINERS) and self.limit != math.inf:
            self.check(text_size(value, self.limit), what)

    def emit(self, size):
        """``size`` more characters of the prompt itself."""
        self.output += size
        if self.output > self.limit:
            raise self.exceeded("max_output_chars", f"the prompt grew past {self.limit:,} "
                                 "characters")

    def iterate(self, values):
        """``values`` (which a filter or loop goes through) with a step per item: counted now
        where they have a length, else as they come."""
        if hasattr(values, "__len__"):
            self.step(len(values))
            return values
        return self._counted(values)

    def _counted(self, values):
        for value in values:
            self.step()
            yield value

    def exceeded(self, field, detail, raised_to=...):
        where = f"from {self.origin}" if self.origin else "(of unknown origin)"
        if raised_to is ...:
            raised_to = f"{getattr(self.budget, field) * 10:_}"
        return ConfigError(
            f"The chat template {where} went over its rendering budget: {detail}. A chat "
            "template is code that comes with a model's files; the budget keeps a hostile or "
            "broken one from taking unbounded CPU and memory. Fix: if you trust the template, "
            f"raise the limit: template.with_budget(TemplateBudget({field}={raised_to})) "
            "(TemplateBudget is in redcoast.models.template_budget; a loaded model's template is "
            "model.chat_template, so model.chat_template = model.chat_template.with_budget(...)),"
            " or TemplateBudget.unlimited() to lift every limit.")


def _or_inf(limit):
    return math.inf if limit is None else limit


def _readable_count(size):
    return f"{size:,}" if size < 10 ** 30 else "about 10**" + str(len(str(size)) - 1)


_CONTAINERS = (list, tuple, dict, set, frozenset, type({}.keys()), type({}.values()),
               type({}.items()))


def text_size(value, limit):
    """An upper bound of the length of ``str(value)``, about as ``repr`` writes containers,
    counting a shared item each time it appears (as ``str``, ``==``, ``hash`` and ``json`` go
    through it again); it stops as soon as it passes ``limit`` (so it costs at most ``limit``
    visits), returning a number over it."""
    total = 0
    pending = [value]
    while pending and total <= limit:
        item = pending.pop()
        if isinstance(item, (str, bytes)):
            total += len(item) + 3
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, _CONTAINERS):
            total += 13 + 2 * len(item)
            pending.extend(item)
        elif _namespace_attributes(item) is not None:
            pending.append(_namespace_attributes(item))
            total += 13
        else:   # a float, a macro, undefined, a loop: a short repr
            total += 32
    return total


def _namespace_attributes(value):
    """A Jinja namespace's attributes (its repr writes them), else None."""
    if not any(kind.__name__ == "Namespace" for kind in type(value).__mro__):
        return None
    try:
        return object.__getattribute__(value, "_Namespace__attrs")
    except AttributeError:
        return None


def operator_size(meter, operator, left, right):
    """Checks (and counts, where exact) what the binary ``operator`` would make of ``left`` and
    ``right`` before it runs: repetition, concatenation, integer growth, ``%`` formatting."""
    sequences = (str, bytes, list, tuple)
    if operator == "*":
        if isinstance(left, int) and isinstance(right, sequences):
            left, right = right, left
        if isinstance(left, sequences) and isinstance(right, int):
            meter.build(len(left) * max(right, 0),
                        f"a {type(left).__name__} repeated {right:,} times")
        elif isinstance(left, int) and isinstance(right, int):
            _check_int_bits(meter, left.bit_length() + right.bit_length())
    elif operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        meter.build(len(left) + len(right), f"a {type(left).__name__} joined to another")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        if abs(left) > 1:
            _check_int_bits(meter, right * left.bit_length())
    elif operator == "%" and isinstance(left, (str, bytes)):
        meter.check(percent_size(left, right, meter.limit), "a %-formatted text")


def _check_int_bits(meter, bits):
    if bits > MAX_INT_BITS and meter.limit != math.inf:
        raise meter.exceeded("max_output_chars", f"it would compute an integer of about "
                              f"{_readable_count(bits)} bits (past {MAX_INT_BITS:,} bits only with "
                              "max_output_chars=None)", raised_to=None)


_PERCENT_SPEC = re.compile(rb"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def percent_size(text, values, limit):
    """An upper bound of ``len(text % values)`` (printf-style: widths, precisions, values)."""
    text_bytes = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    items = values if isinstance(values, tuple) else (values,)
    numbers = [abs(v) for v in items if isinstance(v, int)]
    widest = text_size(values, limit)   # bounds the text of any one value in it
    total = len(text)
    for spec in _PERCENT_SPEC.finditer(text_bytes):
        for number in spec.groups():
            total += _spec_number(number, numbers, limit)
        total += widest + 320   # + the digits of a float's %f
        if total > limit:
            break
    return total


def _spec_number(number, numbers, limit):
    if number is None:
        return 0
    if number == b"*":
        return max(numbers, default=0)
    return int(number) if len(number) < 19 else limit + 1


def format_spec_size(spec, limit):
    """An upper bound of what the numbers of a ``str.format`` field's spec add (width,
    precision)."""
    return sum(int(n) if len(n) < 19 else limit + 1 for n in re.findall(r"\d+", spec))


def method_size(meter, method, args, kwargs):
    """Checks what a str/bytes/int method a template calls would make, before it runs, where its
    arguments can make it far larger than its inputs (widths, tab sizes, replacements,
    translation tables, byte lengths)."""
    owner = getattr(method, "__self__", None)
    name = getattr(method, "__name__", "")
    if isinstance(owner, (str, bytes)):
        what = f"a text from .{name}()"
        if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
            meter.check(max(len(owner), args[0]), what)
        elif name == "expandtabs":
            size = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(size, int):
                tab = "\t" if isinstance(owner, str) else b"\t"
                meter.check(len(owner) + owner.count(tab) * max(size, 0), what)
        elif name == "replace" and len(args) >= 2:
            meter.check(replaced_size(owner, *args[:3], **kwargs), what)
        elif name == "translate" and args:
            meter.check(len(owner) * _longest_value(args[0]), what)
    elif isinstance(owner, int) and name == "to_bytes":
        length = args[0] if args else kwargs.get("length", 1)
        if isinstance(length, int):
            meter.check(length, "bytes from int.to_bytes()")


def replaced_size(text, old, new, count=-1):
    """An upper bound of ``len(text.replace(old, new, count))``."""
    if not isinstance(old, type(text)) or not isinstance(new, type(text)):
        return len(text)   # replace itself refuses these
    found = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(text) + found * max(len(new) - len(old), 0)


def _longest_value(table):
    values = table.values() if isinstance(table, dict) else table if isinstance(
        table, (list, tuple)) else ()
    longest = 1
    for value in values:
        if isinstance(value, (str, bytes)):
            longest = max(longest, len(value))
    return longest
