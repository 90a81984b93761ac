"""Fused projections stored permuted, so that they split by heads like separate ones.

A projection written as one 2-D kernel whose output is cut into k equal parts (Hugging Face
GPT-2's ``c_attn``, (hidden, 3*hidden) cut into Q, K and V; gate and up in one (hidden, 2*ffn)
kernel) cannot be split over S model shards as stored: shard s's contiguous block of the output
axis holds a piece of Q and a piece of K, not whole heads of each. Stored with that axis
permuted, (k, S, n/S) -> (S, k, n/S), shard s's block is made of its slices of the k parts, so
the kernel splits like k separate ones. The function is rewritten to take the stored layout:
the matmul (and any elementwise op with a bias stored alike) gives the permuted output, and each
part is taken out of its shard's block by a reshape and a slice, with no traffic between shards.

* :func:`find_fused_projections` finds such parameters in the traced function. Every use of
  one must be a matmul on its output axis whose result reaches nothing but such cuts (through
  elementwise ops whose other full-width operands are parameters stored alike); anything else
  leaves it as written, decided here, never at run time.
* :func:`to_storage` / :func:`to_user` convert a params tree between the two layouts (plain
  array ops: they run under ``jax.jit`` and on sharded arrays); the round trip is exact.
* :func:`storage_loss` rewrites the function to take stored params.
* :func:`permuted_placements` keeps the permutations the tensor-parallel plan then splits, and
  returns that plan.
* For a training loop: :func:`storage_loss_fn` (the Trainer's loss signature),
  :func:`state_permutations` / :func:`convert_state` (the optimizer state that follows a
  permuted parameter) and :class:`StoredLayout` (jitted conversions placed by a layout's
  shardings, so that every boundary presents the user's layout).
"""

import dataclasses
from typing import Callable

import jax
from jax.extend import core as jcore

from ..errors import ConfigError
from .axes import MODEL_AXIS
from .context import laid_out_for
from .dataflow import TracedPlacements, abstract_tree, dataflow_placements, reshape_groups
from .interpreter import CALLS, REMATS, bind, called, evaluate, follow, opened, output_axes, rerun_inside
from .paths import leaves_with_paths, path_to_tuple

_LAYOUT = ("convert_element_type", "copy", "copy_p", "reduce_precision", "transpose",
           "broadcast_in_dim", "reshape", "squeeze", "expand_dims")
# same-shape ops that mix positions along an axis: not elementwise, whatever their shapes say
_NOT_ELEMENTWISE = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "rev",
                    "reduce_window", "reduce_window_sum", "reduce_window_max", "reduce_window_min",
                    "select_and_scatter_add", "select_and_gather_add", "conv_general_dilated",
                    "fft", "iota", "rng_bit_generator", "random_bits", "gather", "scatter",
                    "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min",
                    "scatter_min", "scatter-max", "scatter_max", "dynamic_slice",
                    "dynamic_update_slice", "pad", "argsort", "top_k")


@dataclasses.dataclass(frozen=True)
class Permutation:
    """Parameter ``axis`` holds ``parts`` equal parts, stored for ``shards`` model shards:
    user (..., parts, shards, rest) <-> storage (..., shards, parts, rest) along that axis."""
    axis: int
    parts: int
    shards: int


def _swap(x, axis, first, second):
    shape = tuple(x.shape)
    width = shape[axis]
    split = shape[:axis] + (first, second, width // (first * second)) + shape[axis + 1:]
    return x.reshape(split).swapaxes(axis, axis + 1).reshape(shape)


def permute(x, perm):
    """One array from the user's layout to the stored one."""
    return _swap(x, perm.axis, perm.parts, perm.shards)


def unpermute(x, perm):
    """One array from the stored layout back to the user's."""
    return _swap(x, perm.axis, perm.shards, perm.parts)


def _convert(params, permutations, one):
    if not permutations:
        return params
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: one(x, permutations[p]) if (p := path_to_tuple(kp)) in permutations else x, params)


def to_storage(params, permutations):
    """``params`` (user layout) with the leaves named in ``permutations`` ({path: Permutation})
    stored permuted."""
    return _convert(params, permutations, permute)


def to_user(params, permutations):
    """Stored ``params`` back in the user's layout (the inverse of :func:`to_storage`)."""
    return _convert(params, permutations, unpermute)


# ---- which parameters: a walk over the traced program ------------------------------------------
@dataclasses.dataclass(frozen=True)
class _View:
    """A parameter seen through layout ops; ``axes[i]``: the parameter axis of axis i, or None."""
    leaf: int
    axes: tuple


@dataclasses.dataclass(frozen=True)
class _Fused:
    """The output of matmuls with candidate weights along ``axis``, not yet cut into parts;
    ``members``: {(leaf, parameter axis)} whose storage decides its layout."""
    axis: int
    members: frozenset


def _shape(v):
    return tuple(getattr(v.aval, "shape", ()))


def _entered(eqn):
    """Whether the stored layout follows ``eqn`` into its body: a call, or a remat whose body
    is a plain Jaxpr."""
    name = eqn.primitive.name
    return name in CALLS or (name in REMATS and isinstance(eqn.params.get("jaxpr"), jcore.Jaxpr))


def _moved(eqn, axis):
    """Where a layout op puts its operand's ``axis`` (None if it does not keep it whole)."""
    name = eqn.primitive.name
    a_shape, b_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if name in ("convert_element_type", "copy", "copy_p", "reduce_precision"):
        return axis
    if name == "transpose":
        return list(eqn.params["permutation"]).index(axis)
    if name == "broadcast_in_dim":
        d = eqn.params["broadcast_dimensions"][axis]
        return d if b_shape[d] == a_shape[axis] else None
    if name == "squeeze":
        dims = {d % len(a_shape) for d in eqn.params["dimensions"]}
        return None if axis in dims else [i for i in range(len(a_shape)) if i not in dims].index(axis)
    for gi, gj in reshape_groups(a_shape, b_shape):  # reshape, expand_dims
        if axis in gi:
            big_i = [i for i in gi if a_shape[i] > 1]
            big_j = [j for j in gj if b_shape[j] > 1]
            ok = big_i == [axis] and len(big_j) == 1 and b_shape[big_j[0]] == a_shape[axis]
            return big_j[0] if ok else None
    return None


def _elementwise(eqn):
    if len(eqn.outvars) != 1 or eqn.primitive.name in _NOT_ELEMENTWISE or _has_body(eqn):
        return False
    out = _shape(eqn.outvars[0])
    return all(_shape(v) == () or (len(_shape(v)) == len(out) and all(
        a in (b, 1) for a, b in zip(_shape(v), out))) for v in eqn.invars)


def _has_body(eqn):
    return eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")) is not None


def _cut(eqn, axis):
    """``(k, part index of each output)`` when ``eqn`` cuts ``axis`` into k equal parts (a
    ``split``, or a ``slice`` of one whole part), else None."""
    shp = _shape(eqn.invars[0])
    name = eqn.primitive.name
    if name == "split":
        sizes = [int(s) for s in eqn.params["sizes"]]
        if eqn.params["axis"] % len(shp) != axis or len(set(sizes)) != 1:
            return None
        return len(sizes), list(range(len(sizes)))
    if name == "slice":
        lo, hi, st = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.params["strides"]
        if any(st or ()) and any(s != 1 for s in st):
            return None
        if any((lo[i], hi[i]) != (0, shp[i]) for i in range(len(shp)) if i != axis):
            return None
        n = hi[axis] - lo[axis]
        if n <= 0 or shp[axis] % n or lo[axis] % n:
            return None
        return shp[axis] // n, [lo[axis] // n]
    return None


class _Analysis:
    def __init__(self):
        self.refused = {}  # leaf -> why it stays as written
        self.cuts = []     # (members, k): a fused output cut into k parts

    def refuse(self, states, reason):
        for s in states:
            if isinstance(s, _View):
                self.refused.setdefault(s.leaf, reason)
            elif isinstance(s, _Fused):
                for leaf, _ in s.members:
                    self.refused.setdefault(leaf, reason)

    def walk(self, jaxpr, ins):
        def step(eqn, states):
            return [] if all(s is None for s in states) else self.step(eqn, states)
        env = follow(jaxpr, ins, step)
        return [env.get(v) if isinstance(v, jcore.Var) else None for v in opened(jaxpr)[0].outvars]

    def step(self, eqn, states):
        name = eqn.primitive.name
        none = [None] * len(eqn.outvars)
        if _entered(eqn):
            return self.walk(opened(called(eqn))[0], states)
        if name in _LAYOUT:
            (s,) = states[:1]
            if isinstance(s, _View):
                return [_View(s.leaf, tuple(s.axes[i] if i is not None else None
                                            for i in self._inverse(eqn)))]
            axis = _moved(eqn, s.axis)
            if axis is None:
                self.refuse(states, f"its fused output goes through '{name}', which does not keep the axis whole")
                return none
            return [_Fused(axis, s.members)]
        if name == "dot_general":
            return [self.dot(eqn, states)]
        fused = states[0] if isinstance(states[0], _Fused) else None
        if fused is not None and (cut := _cut(eqn, fused.axis)) is not None and len(states) == 1:
            self.cuts.append((fused.members, cut[0]))
            return none
        if _elementwise(eqn):
            return [self.elementwise(eqn, states)]
        self.refuse(states, f"it is used by '{name}', which the stored layout cannot pass through")
        return none

    @staticmethod
    def _inverse(eqn):
        """For each output axis of a layout op, the operand axis it is (None: new or merged)."""
        nd_in, nd_out = len(_shape(eqn.invars[0])), len(_shape(eqn.outvars[0]))
        back = [None] * nd_out
        for a in range(nd_in):
            b = _moved(eqn, a)
            if b is not None:
                back[b] = a
        return back

    def dot(self, eqn, states):
        views = [i for i, s in enumerate(states) if isinstance(s, _View)]
        if len(views) != 1 or any(isinstance(s, _Fused) for s in states):
            self.refuse(states, "it meets another parameter or a fused output in a matmul")
            return None
        w = views[0]
        s, shp = states[w], _shape(eqn.invars[w])
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        bound = set((lc, rc)[w]) | set((lb, rb)[w])
        free = [d for d in range(len(shp)) if d not in bound and shp[d] > 1]
        if (lb, rb)[w] or len(free) != 1 or s.axes[free[0]] is None:
            self.refuse(states, "its matmul does not have one output axis of the parameter")
            return None
        return _Fused(output_axes(eqn)[(w, free[0])], frozenset([(s.leaf, s.axes[free[0]])]))

    def elementwise(self, eqn, states):
        out = _shape(eqn.outvars[0])
        fused = [s for s in states if isinstance(s, _Fused)]
        if not fused:
            views = [s for s in states if isinstance(s, _View)]
            others = [v for v, s in zip(eqn.invars, states) if not isinstance(s, _View)]
            if len(views) == 1 and all(all(d == 1 for d in _shape(v)) for v in others):
                (v,) = [v for v, s in zip(eqn.invars, states) if isinstance(s, _View)]
                shp = _shape(v)
                return _View(views[0].leaf, tuple(p if shp[i] == out[i] else None
                                                  for i, p in enumerate(views[0].axes)))
            self.refuse(states, "it is combined elementwise with other arrays")
            return None
        axes = {s.axis for s in fused}
        if len(axes) > 1:
            self.refuse(states, "fused outputs permuted along different axes meet")
            return None
        a = axes.pop()
        members = frozenset().union(*(s.members for s in fused))
        for v, s in zip(eqn.invars, states):
            shp = _shape(v)
            if isinstance(s, _Fused) or shp == () or shp[a] == 1:
                continue
            if isinstance(s, _View) and s.axes[a] is not None:
                members |= {(s.leaf, s.axes[a])}
                continue
            self.refuse(states, "its fused output is combined with an array not stored alike")
            return None
        return _Fused(a, members)

    def decide(self, shapes, n):
        """{leaf: Permutation} for the groups of leaves that share a fused output."""
        parent = {}

        def find(x):
            while parent.setdefault(x, x) != x:
                x = parent[x]
            return x

        for members, _ in self.cuts:
            leaves = [leaf for leaf, _ in members]
            for leaf in leaves[1:]:
                parent[find(leaf)] = find(leaves[0])
        axes, parts = {}, {}
        for members, k in self.cuts:
            for leaf, pa in members:
                axes.setdefault(leaf, set()).add(pa)
                parts.setdefault(find(leaf), set()).add(k)
        groups = {}
        for leaf in axes:
            groups.setdefault(find(leaf), []).append(leaf)
        out = {}
        for root, leaves in groups.items():
            ks = parts[root]
            ok = len(ks) == 1 and all(leaf not in self.refused and len(axes[leaf]) == 1 for leaf in leaves)
            if ok:
                k = next(iter(ks))
                widths = {shapes[leaf][next(iter(axes[leaf]))] for leaf in leaves}
                ok = len(widths) == 1 and (w := widths.pop()) % k == 0 and (w // k) % n == 0 and k > 1
            if ok:
                out.update({leaf: Permutation(next(iter(axes[leaf])), k, n) for leaf in leaves})
        return out


def find_fused_projections(fn, params, *example_args, n_model_shards):
    """``{path: Permutation}`` for the parameters of ``fn(params, *example_args)`` used as fused
    projections whose k parts each split over ``n_model_shards`` (traced on abstract inputs,
    nothing computed)."""
    n = int(n_model_shards)
    if n == 1:
        return {}
    flat = leaves_with_paths(params)
    closed = jax.make_jaxpr(laid_out_for(fn, n, vendor_kernels=False))(abstract_tree(params), *abstract_tree(example_args))
    analysis = _Analysis()
    ins = [_View(i, tuple(range(len(_shape(v))))) if i < len(flat) else None
           for i, v in enumerate(closed.jaxpr.invars)]
    analysis.refuse(analysis.walk(closed.jaxpr, ins), "it is returned by the function")
    found = analysis.decide([tuple(_shape(v)) for v in closed.jaxpr.invars], n)
    return {flat[i][0]: perm for i, perm in found.items()}


# ---- the rewrite ----------------------------------------------------------------------------------
def _part(x, axis, parts, shards, p):
    """Part ``p`` of a stored output permuted along ``axis``, in the user's layout: each shard's
    block (parts, width/shards) gives its slice of the part, so no data crosses shards."""
    shape = tuple(x.shape)
    width = shape[axis] // parts
    blocks = x.reshape(shape[:axis] + (shards, parts, width // shards) + shape[axis + 1:])
    one = jax.lax.slice_in_dim(blocks, p, p + 1, axis=axis + 1)
    return one.reshape(shape[:axis] + (width,) + shape[axis + 1:])


def _mismatch(what):
    return ConfigError(f"a parameter stored permuted (a fused projection) reaches {what} in the "
                       "function being run, which differs from the one its layout was chosen for "
                       "(a loss traced differently from one call to the next). Keep the loss's "
                       "program the same between calls, or turn the permuted storage off.")


def _run(jaxpr, consts, args, marks):
    """Evaluate ``jaxpr``; ``marks[i]``: (axis, (parts, shards)) of an input stored permuted
    along that axis, or None.
    Returns (outputs, their marks)."""
    mark = {v: m for v, m in zip(jaxpr.invars, marks) if m is not None}
    get = lambda v: None if isinstance(v, jcore.Literal) else mark.get(v)  # noqa: E731

    def marked(eqn, vals):
        ms = [get(v) for v in eqn.invars]
        if all(m is None for m in ms):
            return None
        outs, out_marks = _run_marked(eqn, vals, ms)
        mark.update((v, m) for v, m in zip(eqn.outvars, out_marks) if m is not None)
        return outs

    outs = evaluate(jaxpr, args, marked, consts=consts)
    return outs, [get(v) for v in jaxpr.outvars]


def _run_marked(eqn, vals, ms):
    name = eqn.primitive.name
    if _entered(eqn):  # a call inlined, a remat still one: the body sees the stored layout
        found = {}

        def body(jaxpr, consts, args):
            outs, found["marks"] = _run(jaxpr, consts, args, ms)
            return outs
        return rerun_inside(eqn, vals, body), found["marks"]
    outs = bind(eqn, vals) if name != "split" and name != "slice" else None
    if name in _LAYOUT and ms[0] is not None:
        axis = _moved(eqn, ms[0][0])
        if axis is None:
            raise _mismatch(f"'{name}', which does not keep its axis whole")
        return outs, [(axis, ms[0][1])]
    if name == "dot_general":
        marked = [i for i, m in enumerate(ms) if m is not None]
        if len(marked) != 1:
            raise _mismatch("a matmul of two permuted operands")
        w = marked[0]
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        axis = ms[w][0]
        if axis in (lc, rc)[w] or axis in (lb, rb)[w]:
            raise _mismatch("a matmul that contracts its permuted axis")
        return outs, [(output_axes(eqn)[(w, axis)], ms[w][1])]
    if name in ("split", "slice") and ms[0] is not None and len(ms) == 1:
        axis, (parts, shards) = ms[0]
        cut = _cut(eqn, axis)
        if cut is None or cut[0] != parts:
            raise _mismatch(f"a '{name}' that is not a cut into its {parts} parts")
        return [_part(vals[0], axis, parts, shards, p) for p in cut[1]], [None] * len(cut[1])
    if _elementwise(eqn):
        axes = {m for m in ms if m is not None}
        if len(axes) != 1:
            raise _mismatch("an elementwise op with operands stored differently")
        (axis, perm), = axes
        out = _shape(eqn.outvars[0])
        for v, m in zip(eqn.invars, ms):
            if m is None and _shape(v) != () and _shape(v)[axis] != 1 and out[axis] != 1:
                raise _mismatch("an elementwise op with an operand not stored alike")
        return outs, [(axis, perm)]
    raise _mismatch(f"'{name}'")


def storage_loss(fn, permutations):
    """``fn(params, *args)`` rewritten to take ``params`` stored by :func:`to_storage` with
    ``permutations`` ({path: Permutation}); same values (up to summation order: none changes)."""
    if not permutations:
        return fn

    def rewritten(params, *args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(params, *args)
        paths = [path for path, _ in leaves_with_paths(params)]
        missing = set(permutations) - set(paths)
        if missing:
            raise ConfigError(f"parameters {sorted(missing)} are to be stored permuted but are not in "
                              "the params given: pass the params the layout was chosen for.")
        flat = jax.tree_util.tree_leaves((params, args))
        marks = [None if (p := permutations.get(path)) is None else (p.axis, (p.parts, p.shards))
                 for path in paths]
        marks += [None] * (len(flat) - len(paths))
        outs, out_marks = _run(closed.jaxpr, closed.consts, flat, marks)
        if any(m is not None for m in out_marks):
            raise _mismatch("the function's outputs")
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
    return rewritten


def permuted_placements(fn, params, *example_args, n_model_shards, **plan_options):
    """``(placements, permutations)``: the fused projections worth storing permuted (those the
    tensor-parallel plan of the rewritten function then splits on their permuted axis) and that
    plan (of the stored params: same paths and shapes). Raises what
    :func:`~.dataflow.dataflow_placements` raises."""
    perms = find_fused_projections(fn, params, *example_args, n_model_shards=n_model_shards)
    while True:
        placements = dataflow_placements(storage_loss(fn, perms), params, *example_args,
                                         n_model_shards=n_model_shards, **plan_options)
        keep = split_permutations(perms, placements)
        if keep == perms:
            return TracedPlacements([_noted(pl, perms.get(pl.path)) for pl in placements],
                                    placements.all_reduced_elements), perms
        perms = keep


def split_permutations(permutations, placements):
    """The ``permutations`` whose parameter ``placements`` split over 'mp' on the permuted axis
    (the others would gain nothing from being stored permuted)."""
    spec = {pl.path: tuple(pl.spec) for pl in placements}
    return {path: p for path, p in permutations.items()
            if len(spec.get(path, ())) > p.axis and spec[path][p.axis] == MODEL_AXIS}


def _noted(placement, perm):
    if perm is None:
        return placement
    return dataclasses.replace(placement, reason=f"{placement.reason}; stored permuted (a fused "
                               f"projection: each shard's block holds its slice of all {perm.parts} parts)")


def traced_permuted_placements(fn, params, *example_args, n_model_shards, **plan_options):
    """:func:`permuted_placements` as ``(placements, where they came from, permutations)``.
    Where it fails, the plan of ``fn`` as written (:func:`~.dataflow.traced_placements`, with
    its own fallback to the shape rules) with nothing permuted, and the source says why."""
    from .dataflow import traced_placements
    try:
        placements, perms = permuted_placements(fn, params, *example_args, n_model_shards=n_model_shards,
                                                **plan_options)
        return placements, "the traced data flow", perms
    except Exception as e:  # noqa: BLE001 - any program the analysis cannot follow
        why = f"{type(e).__name__}: {e}"
    placements, source = traced_placements(fn, params, *example_args, n_model_shards=n_model_shards,
                                           **plan_options)
    if placements is not None:
        source += f" (fused projections left as written: their analysis failed: {why})"
    return placements, source, {}


def state_permutations(tree, params, permutations):
    """``{path: Permutation}`` for the leaves of ``tree`` (an optimizer state) that follow a
    permuted parameter: a leaf whose path ends with the parameter's path and whose shape is the
    parameter's (adam's moments, momentum), or the parameter's with an axis other than the
    permuted one reduced (adafactor's factored statistics, dropped or kept with size 1)."""
    if not permutations:
        return {}
    shapes = {path: tuple(x.shape) for path, x in leaves_with_paths(params) if path in permutations}
    out = {}
    for path, leaf in leaves_with_paths(tree):
        shape = tuple(getattr(leaf, "shape", ()))
        for start in range(len(path)):
            perm = permutations.get(path[start:])
            if perm is None:
                continue
            pshape, a = shapes[path[start:]], perm.axis
            if shape == pshape or (len(shape) == len(pshape) and shape[a] == pshape[a]
                                   and all(d in (1, p) for d, p in zip(shape, pshape))):
                out[path] = perm
            elif len(shape) == len(pshape) - 1:
                reduced = [r for r in range(len(pshape)) if pshape[:r] + pshape[r + 1:] == shape]
                if len(reduced) == 1 and reduced[0] != a:
                    out[path] = dataclasses.replace(perm, axis=a - (reduced[0] < a))
            break
    return out


def storage_loss_fn(loss_fn, permutations):
    """A Trainer ``loss_fn(rng, state, params, batch, is_training)`` taking stored ``params``
    (the rest is closed over, so Python-level arguments such as ``is_training`` stay static)."""
    if not permutations:
        return loss_fn

    def stored(rng, state, params, batch, is_training):
        return storage_loss(lambda p: loss_fn(rng, state, p, batch, is_training), permutations)(params)
    return stored


def convert_state(state, permutations, to):
    """A train state (``params``, ``opt_state``) with its parameters and the optimizer-state
    leaves that follow them moved to the layout ``to`` (:func:`to_storage` or :func:`to_user`)."""
    if not permutations:
        return state
    opt = state_permutations(state.opt_state, state.params, permutations)
    return state.replace(params=to(state.params, permutations), opt_state=to(state.opt_state, opt))



@dataclasses.dataclass(frozen=True, eq=False)
class StoredLayout:
    """How one layout stores its state: ``permutations`` ({path: Permutation}, empty when none)
    and jitted conversions between the user's layout and the stored one, of a whole train state
    (its params and the optimizer-state leaves that follow them) or of params alone, placed by
    the layout's shardings. The ``*_to_storage`` ones consume their input (a model may fill the
    devices)."""
    permutations: dict
    state_to_user: Callable
    state_to_storage: Callable
    params_to_user: Callable
    params_to_storage: Callable


def stored_layout(permutations, state_shardings):
    """The :class:`StoredLayout` of ``permutations`` for states placed by ``state_shardings``
    (a TrainState of shardings); identities without permutations."""
    if not permutations:
        same = lambda tree: tree  # noqa: E731
        return StoredLayout({}, same, same, same, same)

    def jitted(fn, shardings, donate):
        return jax.jit(fn, out_shardings=shardings, donate_argnums=0 if donate else ())
    params_shardings = state_shardings.params
    return StoredLayout(
        dict(permutations),
        jitted(lambda s: convert_state(s, permutations, to_user), state_shardings, False),
        jitted(lambda s: convert_state(s, permutations, to_storage), state_shardings, True),
        jitted(lambda p: to_user(p, permutations), params_shardings, False),
        jitted(lambda p: to_storage(p, permutations), params_shardings, True))
