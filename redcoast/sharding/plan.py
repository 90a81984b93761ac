"""A parameter placement plan: automatic rules, user overrides, validation, and shardings."""

import warnings

import jax
from jax.sharding import PartitionSpec as P

from ..errors import ConfigError
from .annotations import annotations, warn_unresolved
from .auto import auto_placements
from .axes import DATA_AXIS, MODEL_AXIS
from .fsdp import fsdp_placements, ungrouped_storage
from .grouped_axes import entries as spec_entries
from .grouped_axes import named_sharding
from .grouped_axes import parse as parse_grouped
from .megatron_share import megatron_share, shortfall
from .opt_state import opt_state_specs
from .paths import path_to_str, path_to_tuple
from .permuted import split_permutations
from .rules import (Placement, check_rules_format, check_spec_fits, expand_subtree_rules,
                    first_matching_rule,
                    format_plan, format_rules, generalize_rules, rule_matches)


def splits_over_model_shards(specs):
    """Whether any of ``specs`` (PartitionSpecs) splits a tensor over the model shards ('mp',
    or groups of them)."""
    return any(parse_grouped(name)[0] == MODEL_AXIS for spec in specs for name in spec_entries(spec))


class ShardingPlan:
    """Where every parameter (and optimizer-state leaf) of a model lives on the mesh."""

    def __init__(self, params, mesh, user_rules=None, base_placements=None, fsdp=False, permutations=None,
                 fsdp_keep=frozenset(), fsdp_note=""):
        """``base_placements`` (e.g. from the data-flow analysis) replace the structural rules
        that read only the shapes; user rules override either. ``fsdp`` also splits tensors
        over 'dp' (see fsdp.py), all but the paths in ``fsdp_keep`` (as chosen by fsdp_cost.py,
        which ``fsdp_note`` explains in the table). ``permutations`` ({path: Permutation}, permuted.py):
        fused projections the placements are for stored permuted; kept where the final
        placement splits them on that axis (``self.permutations``)."""
        self.mesh = mesh
        self.axis_sizes = dict(mesh.shape)
        n_model_shards = self.axis_sizes.get(MODEL_AXIS, 1)
        placements = base_placements or auto_placements(params, n_model_shards)
        traced = placements
        annotated = annotations(params)  # the model's own sharding annotations, if any
        if annotated:
            warn_unresolved(annotated)
            placements = [self._apply_annotation(pl, annotated.get(pl.path)) for pl in placements]
        user_rules = expand_subtree_rules(user_rules, params)
        if user_rules:
            check_rules_format(user_rules)
            placements = [self._apply_user_rule(pl, user_rules) for pl in placements]
            warn_unmatched_rules(user_rules, placements)
        # where each parameter is used: the tensor-parallel placement; stored split further
        self.compute_placements = placements
        # what Megatron's split of the traced placements all-reduces (dataflow's
        # TracedPlacements); unknown once an annotation or a user's rule changed one
        kept = [a.spec for a in traced] == [b.spec for b in placements]
        self._all_reduced = getattr(traced, "all_reduced_elements", None) if kept else None
        self.permutations = split_permutations(permutations or {}, placements)
        placements = ungrouped_storage(placements, n_model_shards)
        self.before_fsdp = placements  # stored placements without FSDP: what fsdp_cost.py weighs
        self.fsdp_note = fsdp_note if fsdp else ""
        if fsdp:
            placements = fsdp_placements(placements, self.axis_sizes.get(DATA_AXIS, 1),
                                         n_model_shards=n_model_shards, keep=frozenset(fsdp_keep))
        self.placements = placements
        by_path = {pl.path: pl.spec for pl in placements}
        self.param_specs = jax.tree_util.tree_map_with_path(
            lambda kp, _: by_path[path_to_tuple(kp)], params)

    def _apply_annotation(self, placement, annotation):
        if annotation is None or annotation.spec is None:
            return placement
        entries = [a for axes in annotation.spec for a in ((axes,) if isinstance(axes, str) else axes or ())]
        if len(entries) != len(set(entries)):
            raise ConfigError(
                f"The sharding annotation {annotation.names} of '{path_to_str(placement.path)}' "
                f"({annotation.source}) puts one mesh axis on two dimensions ({annotation.spec} in "
                "redcoast's axes). Fix: name each mesh axis on one dimension at most.")
        check_spec_fits(annotation.spec, placement.shape, self.axis_sizes, placement.path)
        return Placement(placement.path, placement.shape, placement.dtype, annotation.spec,
                         annotation.reason)

    def _apply_user_rule(self, placement, user_rules):
        spec = first_matching_rule(user_rules, placement.path)
        if spec is None:
            return placement
        check_spec_fits(spec, placement.shape, self.axis_sizes, placement.path)
        return Placement(placement.path, placement.shape, placement.dtype, spec, "user rule")

    def splits_over_model_shards(self):
        """Whether the step uses any parameter split over the model shards ('mp', or groups
        of them); with one model shard, True (nothing to decide)."""
        if self.axis_sizes.get(MODEL_AXIS, 1) == 1:
            return True
        return splits_over_model_shards([pl.spec for pl in self.compute_placements])

    def nothing_to_split(self, frozen_split=False):
        """What to say of a plan that splits nothing over several model shards, else None.
        ``frozen_split``: whether frozen parameters (LoRA's base) are split over the model
        shards; then the devices share that work, and there is nothing to say."""
        if frozen_split or self.splits_over_model_shards():
            return None
        n = self.axis_sizes[MODEL_AXIS]
        return (f"the model has nothing to split over {n} model shards: every device repeats the "
                "same work; use n_model_shards=1 or 'auto'")

    def short_of_megatron(self, frozen_split=False):
        """What to say when the plan keeps weights whole that Megatron would split (over
        megatron_share.RATIO times its share per device), else None; a plan with nothing to
        split says so instead (:meth:`nothing_to_split`)."""
        if self.nothing_to_split(frozen_split):
            return None
        return shortfall(self.compute_placements, self.axis_sizes)

    def megatron_share(self):
        """Parameter bytes per device under this plan and under Megatron's split (a Share)."""
        return megatron_share(self.compute_placements, self.axis_sizes)

    def megatron_wire_elements(self, accumulate_grad_batches=1):
        """Values (array elements) one device sends between model shards in one training step
        (``accumulate_grad_batches`` micro-batches) under Megatron's split of this plan: each
        forward all-reduce (row-parallel outputs, vocabulary-parallel lookups, reductions over
        a split axis) and its conjugate in the backward pass, ring all-reduces of the traced
        batch's values over the data shards; None when unknown (no traced plan, or one changed
        by rules) or with one model shard."""
        n = self.axis_sizes.get(MODEL_AXIS, 1)
        if self._all_reduced is None or n == 1:
            return None
        per_device = self._all_reduced / self.axis_sizes.get(DATA_AXIS, 1)
        return 2 * per_device * 2 * (n - 1) / n * accumulate_grad_batches

    def same_placement(self, other):
        return [pl.spec for pl in self.placements] == [pl.spec for pl in other.placements]

    def param_shardings(self):
        return jax.tree_util.tree_map(lambda s: named_sharding(self.mesh, s), self.param_specs,
                                      is_leaf=lambda x: isinstance(x, P))

    def fsdp_paths(self):
        """Paths of the parameters stored split over more devices than where they are used."""
        return [pl.path for pl, used in zip(self.placements, self.compute_placements)
                if pl.spec != used.spec]

    def compute_shardings(self):
        """The shardings the step uses each parameter in: the tensor-parallel placement. A
        parameter FSDP stores split over 'dp' is gathered to it where the step uses it (one
        all-gather, its gradient one reduce-scatter), so the split never reaches activations."""
        by_path = {pl.path: pl.spec for pl in self.compute_placements}
        return jax.tree_util.tree_map_with_path(
            lambda kp, _: named_sharding(self.mesh, by_path[path_to_tuple(kp)]), self.param_specs,
            is_leaf=lambda x: isinstance(x, P))

    def opt_state_shardings(self, opt_state):
        specs = opt_state_specs(opt_state, self.placements)
        return jax.tree_util.tree_map(lambda s: named_sharding(self.mesh, s), specs,
                                      is_leaf=lambda x: isinstance(x, P))

    def rules(self):
        """The plan as the paper's regex rules (paste-able back as ``params_sharding_rules``)."""
        return generalize_rules(self.placements)

    def rules_source(self):
        return format_rules(self.rules())

    def table(self, frozen_split=False):
        """The plan, one parameter a line, and its notes (``frozen_split``: as
        :meth:`nothing_to_split`)."""
        ideal = self.megatron_wire_elements()
        moved = ideal is not None and (f"between model shards per step under Megatron's split of "
                                       f"this plan: {ideal:,.0f} values per device (forward and "
                                       "backward; the compiled step's figure is said after its "
                                       "first step when it is over 1.25x)")
        notes = [n for n in (moved, self.fsdp_note, self.nothing_to_split(frozen_split),
                             self.short_of_megatron(frozen_split)) if n]
        return format_plan(self.placements, self.axis_sizes) + "".join(f"\n{n}" for n in notes)




def warn_unmatched_rules(user_rules, placements):
    """A rule that matches no parameter is most likely a typo: say which (placement unchanged)."""
    for regexes, spec in user_rules:
        regexes = (regexes,) if isinstance(regexes, str) else tuple(regexes)
        if not any(rule_matches(regexes, pl.path) for pl in placements):
            example = "/".join(placements[0].path) if placements else "(none)"
            warnings.warn(f"params_sharding_rules: the rule ({regexes!r}, {spec}) matches no "
                          f"parameter, so it does nothing. Fix: correct its regexes (each fully "
                          f"matches consecutive path entries, e.g. {example}) or remove it.",
                          stacklevel=3)
