"""redco's forms of ``params_sharding_rules``: rules from ``get_sharding_rules`` and per-subtree dicts.

redco scripts compute ``deployer.get_sharding_rules(params)`` and pass the result back; in
redcoast that list stands for "automatic", so the placement traced from the loss's data flow is
used instead of freezing the shape-based guess. A dict of rules per top-level subtree
(``{'model': rules, 'lora': None}``) becomes exact rules for the parameters of each subtree;
``None`` for a subtree means automatic there.
"""

import re
from collections.abc import Mapping

from ..errors import ConfigError
from ..sharding.paths import leaves_with_paths
from ..sharding.rules import check_rules_format, first_matching_rule


class AutoShardingRules(list):
    """Rules printed from redcoast's automatic plan: passed back unchanged, they mean
    "automatic"; once edited they are the user's rules."""

    def __init__(self, rules):
        super().__init__(rules)
        self.as_printed = tuple(rules)

    def edited(self):
        return tuple(self) != self.as_printed


def plain_rules(rules, params):
    """``rules`` in the core's form (a list of (regexes, PartitionSpec), or None for automatic)."""
    if rules is None or (isinstance(rules, AutoShardingRules) and not rules.edited()):
        return None
    if not isinstance(rules, Mapping):
        return rules
    unknown = set(rules) - set(params) if isinstance(params, Mapping) else set(rules)
    if unknown:
        raise ConfigError(
            f"params_sharding_rules has subtrees {sorted(unknown)} that the parameters do not have "
            f"(top-level keys: {sorted(params) if isinstance(params, Mapping) else type(params).__name__}). "
            "Fix: key the rules by the top-level keys of params, or pass one list of rules.")
    exact = []
    for key, sub_rules in rules.items():
        sub_rules = plain_rules(sub_rules, params[key])
        if not sub_rules:
            continue
        check_rules_format(sub_rules)
        for path, _ in leaves_with_paths(params[key]):
            spec = first_matching_rule(sub_rules, path)
            if spec is not None:
                exact.append((tuple(re.escape(p) for p in (str(key),) + path), spec))
    return exact or None
