"""How many bytes a compiled step moves between devices, read from its optimized HLO.

``collective_report(compiled, mesh)`` counts every collective of the compiled program (all-reduce,
all-gather, reduce-scatter, all-to-all, collective-permute, their async ``-start`` forms and
tuple-typed variadic results), multiplies those inside loops by the loop's trip count, and tells
the model-parallel ones (replica groups along 'mp') from the data-parallel ones (along 'dp').
``per_layer`` differences two depths of a model to get the bytes of one layer, which
``megatron_ideal`` gives for Megatron-LM's hand-written plan (``megatron_conv_ideal`` for the
channel split of a CNN's blocks).

Two measures of size are kept: ``bytes`` is the size of the array being reduced or gathered
(the full all-gather output, the full reduce-scatter input), ``wire_bytes`` what one device sends
with ring algorithms (all-reduce 2(g-1)/g of it, all-gather and reduce-scatter (g-1)/g), so that
an all-reduce written as reduce-scatter + all-gather costs the same.
"""

import dataclasses
import re
from collections import defaultdict

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OPS = {  # HLO op name -> kind; '-done' halves of async pairs are not counted again
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-start": "collective-permute",
}
_OP_RE = re.compile(r"\s(" + "|".join(sorted(map(re.escape, _OPS), key=len, reverse=True)) + r")\(")
_ARRAY_RE = re.compile(r"\b(pred|[subfc]\d+|f8e\w+|bf16|f4e\w+|token)\[([0-9,]*)\]")
_ITEMSIZE = {"pred": 1, "bf16": 2, "token": 0}
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_CALLEE_RE = re.compile(r"\b(?:condition|body|calls|to_apply|branch_computations|"
                        r"true_computation|false_computation)=(\{[%\w.\-, ]*\}|%?[\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def _itemsize(dtype):
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    bits = int(re.sub(r"\D", "", dtype.split("e")[0]) or 32)
    return bits / 8


def _arrays(type_text):
    """[(dtype, shape)] of every array in an HLO type (a tuple type gives several)."""
    out = []
    for dtype, dims in _ARRAY_RE.findall(type_text):
        out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def _nbytes(arrays):
    return int(sum(_itemsize(d) * int(np.prod(s, dtype=np.int64)) for d, s in arrays))


def _parse_groups(line):
    """The device groups of a collective, as lists of logical device ids (None if unknown)."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\s*(?:,|$)", line)
    if m:
        return [[int(x) for x in pair.split(",")] for pair in re.findall(r"\{([\d,]+)\}", m.group(1) + "}")]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}", line)
    if m:  # mesh['a'=2,'b'=4] {'a'}: groups along the named axes of a device mesh, row-major
        # unless device_ids gives the device at each position (an iota [dims]T(perm) or a list)
        # names may be quoted and hold ':' or '/' (redcoast's grouped axes: 'mp:2/within')
        axes = re.findall(r"'?([^'=,\s]+)'?\s*=\s*(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        ids = _device_ids(m.group(2), int(np.prod(sizes))).reshape(sizes)
        along = _mesh_axes_along(names, sizes, m.group(3))
        ids = ids.reshape([d for dims in along[1] for d in dims])  # sub-axes split, major first
        chosen = along[0]
        rest = [i for i in range(ids.ndim) if i not in chosen]
        g = int(np.prod([ids.shape[i] for i in chosen])) if chosen else 1
        return ids.transpose(rest + chosen).reshape(-1, g).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:  # iota form: [groups, size]<=[reshape]T(perm)
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    m = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:\s*,\s*\{[\d,\s]*\})*)?\}", line)
    if m:
        if not m.group(1):
            return []  # {}: all devices in one group
        return [[int(x) for x in grp.split(",") if x.strip()] for grp in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
    return None


# one entry of a mesh collective's axes: 'name' (or name), optionally a sub-axis 'name':(p)s
_MESH_AXIS_RE = re.compile(r"(?:'([^']+)'|([\w./-]+))(?::\((\d+)\)(\d+))?")


def _mesh_axes_along(names, sizes, text):
    """``(dims along, [dims of each axis])`` for a collective over ``text``'s axes (``'mp'``,
    or Shardy's sub-axis ``'mp':(2)2``: of axis 'mp', the factor of size 2 after (more minor
    than) a factor of size 2). Each axis is split, major first, at every sub-axis boundary
    named, so that a sub-axis is a run of whole dimensions; its dimensions are returned."""
    entries = []
    for quoted, plain, pre, size in _MESH_AXIS_RE.findall(text):
        name = quoted or plain
        entries.append((names.index(name), int(pre) if pre else None, int(size) if size else None))
    splits = []
    for i, n in enumerate(sizes):  # boundaries in "pre-size": 1 .. n
        bounds = {1, n}
        for axis, pre, size in entries:
            if axis == i and pre is not None:
                bounds |= {pre, pre * size}
        bounds = sorted(bounds)
        splits.append(bounds)
    dims = [[b / a for a, b in zip(bounds, bounds[1:])] or [1] for bounds in splits]
    dims = [[int(d) for d in ds] for ds in dims]
    first = np.cumsum([0] + [len(ds) for ds in dims])
    chosen = []
    for axis, pre, size in entries:
        bounds = splits[axis]
        if pre is None:
            chosen += list(range(first[axis], first[axis] + len(dims[axis])))
        else:
            lo, hi = bounds.index(pre), bounds.index(pre * size)
            chosen += [first[axis] + j for j in range(lo, hi)]
    return [int(c) for c in chosen], dims


def _device_ids(text, total):
    """The device ids of ``device_ids=(...)`` in mesh order: ``[2,2,2]T(1,0,2)`` or ``0,2,1,3``."""
    if not text:
        return np.arange(total)
    m = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
    if m:
        ids = np.arange(total).reshape([int(x) for x in m.group(1).split(",")])
        if m.group(2):
            ids = ids.transpose([int(x) for x in m.group(2).split(",")])
        return ids.reshape(-1)
    return np.array([int(x) for x in text.split(",")])


def _classify(groups, mesh_shape, kind):
    """'mp', 'dp', 'all', 'mixed' or 'unknown': the mesh axes a collective's groups run along.

    Logical device i sits at row-major position i of the mesh (the order jax.jit assigns them).
    """
    if groups is None or mesh_shape is None:
        return "unknown"
    names = list(mesh_shape)
    sizes = [mesh_shape[a] for a in names]
    total = int(np.prod(sizes))
    if groups == []:
        return "all"
    if kind == "collective-permute":
        groups = [pair for pair in groups if pair[0] != pair[1]]
        if not groups:
            return "none"
    coords = lambda i: np.unravel_index(i, sizes)
    varying = set()
    for grp in groups:
        if any(i >= total for i in grp):
            return "unknown"
        cs = np.array([coords(i) for i in grp])
        varying |= {names[k] for k in range(len(names)) if len(set(cs[:, k])) > 1}
    if not varying:
        return "none"
    if len(varying) == 1:
        return next(iter(varying))
    return "all" if varying == set(names) and all(len(g) == total for g in groups) else "mixed"


@dataclasses.dataclass
class Collective:
    """One collective instruction of the compiled program."""
    kind: str         # one of KINDS
    op: str           # the HLO op name (e.g. 'all-reduce-start')
    bytes: int        # size of the full array reduced / gathered / scattered / sent
    wire_bytes: float  # bytes one device sends, ring algorithms
    group_size: int
    axis: str         # 'mp', 'dp', 'all', 'mixed', 'none' or 'unknown'
    times: int        # how often it runs per call (trip counts of enclosing loops)
    computation: str
    line: str
    elements: int = 0  # array elements in ``bytes`` (its values, whatever their precision)


class CollectiveReport:
    """The collectives of one compiled program; totals count loop iterations."""

    def __init__(self, collectives, unknown_trip_counts=0):
        self.collectives = collectives
        self.unknown_trip_counts = unknown_trip_counts

    def _select(self, kind=None, axis=None):
        axes = (axis,) if isinstance(axis, str) else axis
        return [c for c in self.collectives
                if (kind is None or c.kind == kind) and (axes is None or c.axis in axes)]

    def count(self, kind=None, axis=None):
        """Collectives run per call (a tuple-typed variadic one counts once)."""
        return sum(c.times for c in self._select(kind, axis))

    def bytes(self, kind=None, axis=None):
        return sum(c.bytes * c.times for c in self._select(kind, axis))

    def wire_bytes(self, kind=None, axis=None):
        return sum(c.wire_bytes * c.times for c in self._select(kind, axis))

    def by_kind(self, axis=None):
        """{kind: (count, bytes)} for the kinds present."""
        out = {}
        for k in KINDS:
            n = self.count(k, axis)
            if n:
                out[k] = (n, self.bytes(k, axis))
        return out

    def by_axis(self):
        """{axis: (count, bytes, wire_bytes)}."""
        out = defaultdict(lambda: [0, 0, 0.0])
        for c in self.collectives:
            row = out[c.axis]
            row[0] += c.times
            row[1] += c.bytes * c.times
            row[2] += c.wire_bytes * c.times
        return {a: tuple(v) for a, v in out.items()}

    def summary(self):
        lines = [f"{'kind':<20}{'axis':<8}{'count':>7}{'bytes':>14}{'wire bytes':>14}"]
        rows = defaultdict(lambda: [0, 0, 0.0])
        for c in self.collectives:
            r = rows[(c.kind, c.axis)]
            r[0] += c.times
            r[1] += c.bytes * c.times
            r[2] += c.wire_bytes * c.times
        for (kind, axis), (n, b, w) in sorted(rows.items()):
            lines.append(f"{kind:<20}{axis:<8}{n:>7}{b:>14,}{int(w):>14,}")
        return "\n".join(lines)

    def __repr__(self):
        return f"CollectiveReport({self.by_axis()})"


def _hlo_text(compiled):
    if isinstance(compiled, str):
        return compiled
    return compiled.as_text()


def hlo_computations(text):
    """``({name: [instruction lines]}, entry name)`` of a compiled module's HLO text."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        m = _COMP_RE.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
        elif current is not None:
            if line.strip() == "}":
                current = None
            else:
                comps[current].append(line)
    return comps, entry


def hlo_multiplicities(comps, entry):
    """``({name: runs}, loops of unknown trip count)``: how many times each computation of
    :func:`hlo_computations` runs per call of the entry (a loop counts its known trips)."""
    edges = defaultdict(list)  # caller -> [(callee, factor)]
    unknown = 0
    for name, lines in comps.items():
        for line in lines:
            factor = 1
            if " while(" in line:
                m = _TRIP_RE.search(line)
                if m:
                    factor = int(m.group(1))
                else:
                    unknown += 1
            for group in _CALLEE_RE.findall(line):
                for callee in group.strip("{}").split(","):
                    callee = callee.strip().lstrip("%")
                    if callee in comps:
                        edges[name].append((callee, factor))
    times = defaultdict(int)

    def visit(name, t, depth=0):
        times[name] += t
        if depth < 64:
            for callee, f in edges[name]:
                visit(callee, t * f, depth + 1)

    if entry is None:
        for name in comps:
            times[name] = 1
    else:
        visit(entry, 1)
    return times, unknown


def collective_report(compiled, mesh=None):
    """Every collective in ``compiled.as_text()`` (or HLO text), with sizes and mesh axes.

    ``mesh`` (a ``jax.sharding.Mesh`` or a ``{axis: size}`` dict, row-major device order) lets
    each collective be attributed to 'mp' (between model shards), 'dp' (data-parallel gradient
    reduction), or 'all'/'mixed' (both at once).
    """
    text = _hlo_text(compiled)
    mesh_shape = None if mesh is None else dict(getattr(mesh, "shape", mesh))
    comps, entry = hlo_computations(text)
    times, unknown = hlo_multiplicities(comps, entry)
    out = []
    for name, lines in comps.items():
        for line in lines:
            m = _OP_RE.search(line)
            if not m or "=" not in line[:m.start()]:
                continue
            op = m.group(1)
            kind = _OPS[op]
            arrays = _arrays(line[line.index("=") + 1:m.start()])
            if op == "all-gather-start":  # ((operands), (outputs)): keep the outputs
                arrays = arrays[len(arrays) // 2:]
            elif op == "collective-permute-start":  # (operand, output, u32[] contexts...)
                arrays = arrays[:1]
            groups = _parse_groups(line)
            if groups is None or groups == []:
                g = int(np.prod(list(mesh_shape.values()))) if mesh_shape else 1
            elif kind == "collective-permute":
                g = 2
            else:
                g = len(groups[0])
            size = _nbytes(arrays)
            elements = int(sum(int(np.prod(s, dtype=np.int64)) for _, s in arrays))
            if kind == "reduce-scatter":
                size, elements = size * g, elements * g  # the result is one piece of the input
            if kind == "all-reduce":
                wire = 2 * (g - 1) / g * size
            elif kind == "collective-permute":
                wire = float(size)
            else:
                wire = (g - 1) / g * size
            out.append(Collective(kind, op, size, wire, g, _classify(groups, mesh_shape, kind),
                                  times.get(name, 1), name, line.strip(), elements))
    return CollectiveReport(out, unknown)


def megatron_ideal(batch_per_device, seq, hidden, n_model_shards, itemsize=4, cross_attention=False,
                   recompute=False):
    """Megatron-LM's per-layer model-parallel traffic for one training step (forward + backward).

    Forward: two all-reduces of the [batch, seq, hidden] activation per layer (three for a decoder
    layer with cross-attention); backward the same again. With ``recompute`` (a layer under
    ``jax.checkpoint``, Megatron's full activation recomputation) the backward pass first runs the
    layer's forward again, all-reduces included. Returns ``{'count', 'bytes', 'wire_bytes'}`` for
    one device.
    """
    n = (3 if recompute else 2) * (3 if cross_attention else 2)
    act = batch_per_device * seq * hidden * itemsize
    g = n_model_shards
    return {"count": n, "bytes": n * act, "wire_bytes": n * 2 * (g - 1) / g * act}


def megatron_conv_ideal(activations, n_model_shards, itemsize=4):
    """Megatron's channel split of a CNN's residual blocks, for one training step on one device:
    per block, one all-reduce of its [batch, H, W, C] output forward (after its row-parallel
    convolution) and one of its input gradient backward (before its column-parallel one).
    ``activations``: the per-device [batch, H, W, C] of each block counted. Returns
    ``{'count', 'bytes', 'wire_bytes'}`` as :func:`megatron_ideal`."""
    act = sum(int(np.prod(a)) for a in activations) * itemsize
    g = n_model_shards
    return {"count": 2 * len(activations), "bytes": 2 * act, "wire_bytes": 2 * 2 * (g - 1) / g * act}


def per_layer(compile_fn, mesh=None, depths=(2, 4)):
    """Per-layer collective traffic: the difference of two depths of the same model.

    ``compile_fn(n_layers)`` returns a compiled step (or HLO text). Returns ``{axis: {'count',
    'bytes', 'wire_bytes'}}`` per layer, the reports of both depths under ``'reports'``.
    """
    a, b = depths
    ra, rb = collective_report(compile_fn(a), mesh), collective_report(compile_fn(b), mesh)
    out = {}
    for axis in set(ra.by_axis()) | set(rb.by_axis()):
        out[axis] = {"count": (rb.count(axis=axis) - ra.count(axis=axis)) / (b - a),
                     "bytes": (rb.bytes(axis=axis) - ra.bytes(axis=axis)) / (b - a),
                     "wire_bytes": (rb.wire_bytes(axis=axis) - ra.wire_bytes(axis=axis)) / (b - a)}
    out["reports"] = (ra, rb)
    return out
