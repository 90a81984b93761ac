"""redco's forms of ``params_sharding_rules``: rules from ``get_sharding_rules`` and per-subtree dicts.

redco scripts compute ``deployer.get_sharding_rules(params)`` and pass the result back; in
redcoast that list stands for "automatic", so the placement traced from the loss's data flow is
used instead of freezing the shape-based guess. A dict of rules per top-level subtree
(``{'model': rules, 'lora': None}``) is the core's too (``sharding.rules.expand_subtree_rules``):
exact rules for the parameters of each subtree, ``None`` for a subtree meaning automatic there.
"""

from collections.abc import Mapping


class AutoShardingRules(list):
    """Rules printed from redcoast's automatic plan: passed back unchanged, they mean
    "automatic"; once edited they are the user's rules."""

    def __init__(self, rules):
        super().__init__(rules)
        self.as_printed = tuple(rules)

    def edited(self):
        return tuple(self) != self.as_printed


def plain_rules(rules, params):
    """``rules`` in the core's form: a list of (regexes, PartitionSpec), a dict of such lists per
    top-level subtree, or None for automatic; rules printed by ``get_sharding_rules`` and passed
    back unedited (at the top or for a subtree) mean automatic."""
    if rules is None or (isinstance(rules, AutoShardingRules) and not rules.edited()):
        return None
    if isinstance(rules, Mapping) and isinstance(params, Mapping):
        rules = {key: plain_rules(sub, params[key]) if key in params else sub
                 for key, sub in rules.items()}
    return rules
