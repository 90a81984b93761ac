"""Sharding rules in the paper's format: a list of ``(tuple of regexes, PartitionSpec)``.

A rule matches a parameter when its regexes, in order, fully match consecutive entries of the
parameter's path (``('params', 'h_0', 'attn', 'c_attn', 'kernel')``). The first matching rule wins.
"""

import dataclasses
import re
from collections.abc import Mapping

import numpy as np
from jax.sharding import PartitionSpec as P

from ..errors import ConfigError
from .grouped_axes import axis_size, per_device_pieces
from .paths import leaves_with_paths, path_to_str


def normalize_spec(spec):
    """The spec without trailing ``None`` entries: P('mp', None) and P('mp') mean the same."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one parameter goes, and why."""
    path: tuple
    shape: tuple
    dtype: object
    spec: P
    reason: str
    # a matmul, convolution or embedding weight the data flow saw: Megatron would split it
    weight: bool = False
    # kept whole as a router (split_ends.py): the routing computed from its output is pinned
    # whole too (fusion.py), or XLA splits it along the experts it feeds
    routes: bool = False

    def __post_init__(self):
        object.__setattr__(self, "spec", normalize_spec(self.spec))

    def bytes_per_device(self, axis_sizes):
        """Bytes of this parameter on one device, given the mesh axis sizes."""
        n = int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize
        return n // per_device_pieces(self.spec, axis_sizes)


def _as_tuple(axes):
    if axes is None:
        return ()
    return axes if isinstance(axes, tuple) else (axes,)


def rule_matches(regexes, path):
    """True when ``regexes`` fully match a window of consecutive entries of ``path``."""
    n = len(regexes)
    compiled = [re.compile(r) for r in regexes]
    for start in range(len(path) - n + 1):
        if all(c.fullmatch(k) for c, k in zip(compiled, path[start:start + n])):
            return True
    return False


def first_matching_rule(rules, path):
    for regexes, spec in rules:
        if isinstance(regexes, str):
            regexes = (regexes,)
        if rule_matches(tuple(regexes), path):
            return spec
    return None


def check_rules_format(rules):
    """Raise a clear error unless ``rules`` is a list of (tuple of regexes, PartitionSpec)."""
    for i, rule in enumerate(rules):
        ok = isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[1], P)
        if ok:
            regexes = (rule[0],) if isinstance(rule[0], str) else rule[0]
            ok = isinstance(regexes, (tuple, list)) and all(isinstance(r, str) for r in regexes)
        if not ok:
            raise ConfigError(
                f"Sharding rule #{i} is {rule!r}, not a (tuple of regexes, PartitionSpec). Fix: write "
                "rules like [(('attention', 'query', 'kernel'), PartitionSpec(None, 'mp')), ...].")
        for r in regexes:
            try:
                re.compile(r)
            except re.error as e:
                raise ConfigError(f"Sharding rule #{i} has an invalid regex {r!r}: {e}.") from e


def expand_subtree_rules(rules, params):
    """Rules keyed by the top-level keys of ``params`` (redco's form: ``{'model': [rules],
    'lora': None}``, ``None`` = automatic there) as one list of exact rules, each for the
    parameters its subtree's rules match; any other ``rules`` unchanged."""
    if not isinstance(rules, Mapping):
        return rules
    keys = set(params) if isinstance(params, Mapping) else set()
    unknown = set(rules) - keys
    if unknown:
        raise ConfigError(
            f"params_sharding_rules has subtrees {sorted(map(str, unknown))} that the parameters "
            f"do not have (top-level keys: "
            f"{sorted(map(str, keys)) if isinstance(params, Mapping) else type(params).__name__}). "
            "Fix: key the rules by the top-level keys of params, or pass one list of rules.")
    exact = []
    for key, sub_rules in rules.items():
        if not sub_rules:
            continue
        if isinstance(sub_rules, Mapping):
            raise ConfigError(f"params_sharding_rules[{key!r}] is a dict; rules per subtree go one "
                              "level deep. Fix: give a list of (regexes, PartitionSpec) or None.")
        check_rules_format(sub_rules)
        for path, _ in leaves_with_paths(params[key]):
            spec = first_matching_rule(sub_rules, path)
            if spec is not None:
                exact.append((tuple(re.escape(p) for p in (str(key),) + path), spec))
    return exact or None


def check_spec_fits(spec, shape, axis_sizes, path):
    """Raise a clear error if ``spec`` cannot shard an array of ``shape`` on this mesh."""
    where = path_to_str(path)
    if len(spec) > len(shape):
        raise ConfigError(
            f"The PartitionSpec {spec} for '{where}' has {len(spec)} entries but the parameter has "
            f"shape {shape}. Fix: give at most {len(shape)} entries in the rule for it.")
    for dim, axes in enumerate(spec):
        n = 1
        for axis in _as_tuple(axes):
            size = axis_size(axis, axis_sizes)
            if size is None:
                raise ConfigError(
                    f"The PartitionSpec {spec} for '{where}' names mesh axis {axis!r}; the mesh has "
                    f"{tuple(axis_sizes)}. Fix: use 'mp' (model shards) or 'dp' (data parallel), or "
                    "'mp:k' (k consecutive groups of the model shards, k dividing their number).")
            n *= size
        if shape[dim] % n:
            raise ConfigError(
                f"The PartitionSpec {spec} for '{where}' splits dimension {dim} (size {shape[dim]}) "
                f"into {n} parts, which does not divide. Fix: change the rule for '{where}', or "
                "use a number of model shards that divides it.")


def generalize_rules(placements):
    """Compress per-parameter placements into regex rules, merging layers that differ by index.

    Digits in a path become ``\\d+`` wherever every parameter matching the generalized rule has
    the same spec, so a 24-layer model prints a handful of rules instead of hundreds. Longer
    (deeper) rules come first, and the result is checked to reproduce every placement exactly;
    if it did not, the exact per-parameter rules are returned instead.
    """
    def pattern(path, fixed):
        return tuple(re.escape(k) if i in fixed else re.sub(r"\d+", r"\\d+", re.escape(k))
                     for i, k in enumerate(path))

    rules = []

    def split(members, fixed):
        groups = {}
        for pl in members:
            groups.setdefault(pattern(pl.path, fixed), []).append(pl)
        for pat, group in groups.items():
            if len({pl.spec for pl in group}) == 1:
                rules.append((pat, group[0].spec))
                continue
            differing = [i for i in range(len(group[0].path)) if i not in fixed
                         and len({pl.path[i] for pl in group}) > 1]
            split(group, fixed | {differing[-1]})

    split(placements, frozenset())
    rules.sort(key=lambda rule: -len(rule[0]))
    if all(first_matching_rule(rules, pl.path) == pl.spec for pl in placements):
        return rules
    return [(pattern(pl.path, frozenset(range(len(pl.path)))), pl.spec) for pl in placements]


def format_rules(rules):
    """The rules as Python source a user can paste back as ``params_sharding_rules``."""
    lines = ["["]
    for regexes, spec in rules:
        lines.append(f"    ({tuple(regexes)!r}, PartitionSpec{tuple(spec)!r}),")
    lines.append("]")
    return "\n".join(lines)


def format_plan(placements, axis_sizes):
    """A table: path, shape, spec, bytes per device, reason."""
    rows = [("parameter", "shape", "spec", "bytes/device", "reason")]
    total = 0
    for pl in placements:
        b = pl.bytes_per_device(axis_sizes)
        total += b
        rows.append((path_to_str(pl.path), str(tuple(pl.shape)), str(tuple(pl.spec)), f"{b:,}", pl.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    lines.append(f"parameter bytes per device: {total:,}")
    return "\n".join(lines)
