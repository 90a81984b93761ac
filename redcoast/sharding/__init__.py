"""Parameter placement: automatic tensor-parallel rules, user rules, optimizer state."""

from .auto import auto_placements
from .plan import ShardingPlan
from .rules import first_matching_rule, format_rules, generalize_rules

__all__ = ["ShardingPlan", "auto_placements", "first_matching_rule", "format_rules",
           "generalize_rules"]
