"""What the rewrites of the traced loss (fusion.py) know of a sharding plan, as one value.

The rewrites decide per matmul whether its weight is split over the model shards, so they need
the plan per parameter: which axes of each parameter leaf the plan splits over 'mp' (or over
groups of the shards, grouped_axes.py), how many model shards there are, and the mesh (to pin
values whole on it). Keyed by the parameter's path, never by its shape: two weights of one shape
may be placed differently.
"""

import dataclasses

from ..errors import ConfigError
from .axes import DATA_AXIS, MODEL_AXIS
from .grouped_axes import parse as parse_grouped
from .paths import path_to_str


@dataclasses.dataclass(frozen=True)
class WeightSplit:
    """One parameter leaf: its path and shape, and ``axes``: ((axis, groups), ...) for each axis
    the plan splits over the model shards (``groups`` None: over every shard; k: over k groups
    of consecutive shards). ``routes``: a router kept whole (rules.Placement.routes)."""
    path: tuple
    shape: tuple
    axes: tuple = ()
    routes: bool = False

    def groups(self, axis):
        """None when the plan does not split ``axis``; else the entry's ``groups`` as ``(groups,)``."""
        for a, g in self.axes:
            if a == axis:
                return (g,)
        return None


@dataclasses.dataclass(frozen=True)
class RewritePlan:
    """The plan the rewrites run under.

    ``blocks``: the number of model shards (the 'mp' axis). ``mesh``: the mesh the step runs on,
    or None (then nothing is pinned to it). ``data_shards``: the data-parallel size (the 'dp'
    axis; the traced batch is global). ``weights``: a :class:`WeightSplit` per parameter leaf of
    the rewritten function's first argument (each leaf's is found by its path, so their order
    does not matter), or None when the plan is not known: then every group of sibling matmuls
    is fused and no rewrite that needs the plan runs.
    """
    blocks: int = 1
    mesh: object = None
    data_shards: int = 1
    weights: tuple = None

    @classmethod
    def from_sharding_plan(cls, plan):
        """The rewrite plan of a :class:`~redcoast.sharding.plan.ShardingPlan`: its mesh and the
        placements the step uses the parameters in (``compute_placements``)."""
        return cls.from_placements(plan.compute_placements, plan.mesh)

    @classmethod
    def from_placements(cls, placements, mesh=None, n_model_shards=None, axis_name=MODEL_AXIS):
        """From one :class:`~redcoast.sharding.rules.Placement` per parameter leaf and the
        mesh's 'mp' and 'dp' sizes (or ``n_model_shards`` without a mesh). A split over several
        mesh axes at once (FSDP's ('dp', 'mp')) is not a split over the model shards: not
        counted."""
        sizes = dict(mesh.shape) if mesh is not None else {}
        blocks = sizes.get(axis_name, 1) if n_model_shards is None else int(n_model_shards)
        if mesh is not None and blocks != sizes.get(axis_name, 1):
            raise ConfigError(f"{n_model_shards} model shards on a mesh whose {axis_name!r} axis "
                              f"has {sizes.get(axis_name, 1)}. Fix: give one of them.")
        weights = []
        for pl in placements:
            axes = []
            for axis, entry in enumerate(tuple(pl.spec)):
                names = entry if isinstance(entry, tuple) else (entry,)
                if len(names) == 1:
                    name, groups = parse_grouped(names[0])
                    if name == axis_name:
                        axes.append((axis, groups))
            weights.append(WeightSplit(tuple(pl.path), tuple(pl.shape), tuple(axes), pl.routes))
        return cls(blocks=blocks, mesh=mesh, data_shards=sizes.get(DATA_AXIS, 1), weights=tuple(weights))

    @property
    def knows_placements(self):
        return self.weights is not None

    def leaf_splits(self, leaves_with_paths):
        """The :class:`WeightSplit` of each ``(path, leaf)`` of the parameters being traced,
        found by path (a missing or differently shaped one is an error: the plan is for other
        parameters)."""
        by_path = {w.path: w for w in self.weights}
        out = []
        for path, leaf in leaves_with_paths:
            w = by_path.get(tuple(path))
            if w is None or tuple(w.shape) != tuple(getattr(leaf, "shape", ())):
                found = "no parameter" if w is None else f"shape {tuple(w.shape)}"
                where = path_to_str(path) or "(the argument itself)"
                raise ConfigError(
                    f"the rewrite plan has {found} at {where}, where the traced parameters have "
                    f"shape {tuple(getattr(leaf, 'shape', ()))}. Fix: build the plan "
                    "(RewritePlan.from_sharding_plan) from the plan of these parameters.")
            out.append(w)
        return out
