"""Sharding annotations written into a model's parameters, read as the user's placement.

Flax models carry partitioning metadata: NNX variables made with ``nnx.with_partitioning``
(metadata ``out_sharding``; ``sharding_names`` or ``sharding`` in earlier Flax releases), linen
boxes from ``nn.with_partitioning`` (``Partitioned``) and ``nn.with_logical_partitioning``
(``LogicallyPartitioned``). Each names, per dimension, a mesh axis or a logical axis that
Flax's logical axis rules map to one (the rules in the variable's metadata, else those in effect:
``nn.logical_axis_rules`` / ``nnx.logical_axis_rules`` / ``flax.core.spmd.set_logical_axis_rules``).

redcoast's mesh has two axes, so the usual names of a tensor-parallel axis ('mp', 'model',
'tensor', 'tp') mean 'mp' and those of a data axis ('dp', 'data', 'fsdp', 'batch') mean 'dp'.
A parameter annotated so is placed exactly as written: over the automatic plan, under the user's
``params_sharding_rules`` (which override it), never split further by FSDP. An annotation that
names anything else is not guessed at: it is reported, and the automatic plan places that
parameter.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
from jax.sharding import PartitionSpec as P

from .axes import DATA_AXIS, MODEL_AXIS
from .paths import path_to_str, path_to_tuple

MODEL_AXES = (MODEL_AXIS, "model", "tensor", "tp")
DATA_AXES = (DATA_AXIS, "data", "fsdp", "batch")
NNX_KEYS = ("out_sharding", "sharding_names", "sharding")  # newest Flax first
REASON = "annotation"


@dataclasses.dataclass(frozen=True)
class Annotation:
    """One parameter's annotation: ``names`` as written, where they came from (``source``),
    and ``spec`` in redcoast's axes (None when a name is neither a mesh axis nor mapped by the
    logical axis rules: those are ``unknown``)."""

    names: tuple
    source: str
    spec: P | None
    unknown: tuple = ()

    @property
    def reason(self) -> str:
        return f"{REASON} ({self.source} {self.names})"


def annotations(params) -> dict[tuple, Annotation]:
    """``{leaf path: Annotation}`` for every annotated leaf of ``params`` (paths as
    ``sharding.paths`` gives them, e.g. ('params', 'Dense_0', 'kernel', 'value'))."""
    found = {}
    for prefix, node in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_annotated)[0]:
        written = _written(node)
        if written is None:
            continue
        names, rules, source = written
        annotation = _resolved(tuple(names), rules, source)
        for suffix, _ in jax.tree_util.tree_flatten_with_path(node)[0]:
            found[path_to_tuple(tuple(prefix) + tuple(suffix))] = annotation
    return found


def warn_unresolved(found: dict[tuple, Annotation]) -> None:
    """Say which annotations name axes redcoast cannot map (the automatic plan places those)."""
    for path, annotation in found.items():
        if annotation.spec is None:
            warnings.warn(
                f"the sharding annotation {annotation.names} of '{path_to_str(path)}' "
                f"({annotation.source}) names {', '.join(map(repr, annotation.unknown))}, neither "
                f"a mesh axis ({'/'.join(MODEL_AXES)} for the model shards, {'/'.join(DATA_AXES)} "
                "for the data shards) nor mapped to one by Flax's logical axis rules, so it is "
                "not applied and the automatic plan places that parameter. Fix: set the rules "
                "(flax.core.spmd.set_logical_axis_rules([('mlp', 'model'), ...]) before building "
                "the Trainer) or annotate with mesh axis names.", stacklevel=4)


def _is_annotated(node) -> bool:
    return _written(node) is not None


def _written(node):
    """``(names, rules, source)`` of an annotated NNX variable or linen box, else None."""
    from flax import nnx
    from flax.core import meta
    from flax.linen import spmd as linen_spmd
    if isinstance(node, nnx.Variable):
        metadata = node.get_metadata() if hasattr(node, "get_metadata") else vars(node)
        for key in NNX_KEYS:
            names = metadata.get(key)
            if names and not isinstance(names, jax.sharding.Sharding):
                return tuple(names), metadata.get("sharding_rules"), f"nnx {key}"
        return None
    if isinstance(node, linen_spmd.LogicallyPartitioned):
        return tuple(node.names), node.rules, "linen LogicallyPartitioned"
    if isinstance(node, meta.Partitioned):
        return tuple(node.names), None, "linen Partitioned"
    return None


def _resolved(names: tuple, rules, source: str) -> Annotation:
    """The annotation with its spec in redcoast's axes (logical names mapped by ``rules``, or
    Flax's rules in effect; a logical axis takes the first rule whose mesh axis is still free)."""
    if rules is None:
        from flax.core import spmd
        rules = spmd.get_logical_axis_rules()
    rules = list(rules or ())
    used: set = set()
    entries, unknown = [], []
    for entry in names:
        axes = []
        for name in (entry if isinstance(entry, tuple) else (entry,)):
            if name is None:
                continue
            axis = _mesh_axis(name)
            if axis is None:  # a logical name: the first rule to a free mesh axis
                for logical, target in rules:
                    if logical != name:
                        continue
                    targets = target if isinstance(target, tuple) else (target,)
                    mapped = [_mesh_axis(t) for t in targets if t is not None]
                    if all(m is not None and m not in used for m in mapped):
                        axis = tuple(mapped) or "replicated"
                        break
            if axis is None:
                unknown.append(name)
            elif axis != "replicated":
                for a in axis if isinstance(axis, tuple) else (axis,):
                    if a not in axes:
                        axes.append(a)
        used.update(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    if unknown:
        return Annotation(names, source, None, tuple(unknown))
    return Annotation(names, source, P(*entries))


def _mesh_axis(name):
    """'mp' or 'dp' for a mesh axis name redcoast knows, else None."""
    if name in MODEL_AXES:
        return MODEL_AXIS
    if name in DATA_AXES:
        return DATA_AXIS
    return None
