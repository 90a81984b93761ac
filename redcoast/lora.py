"""LoRA: low-rank adapters on chosen matmul kernels of any params tree, the base left frozen.

A targeted kernel ``W`` (shape ``stack + in + out``) gets ``A`` (``stack + in + (rank,)``,
small random) and ``B`` (``stack + (rank,) + out``, zeros), and the model runs with
``W + alpha / rank * A @ B``: at the start exactly the base model. Only the adapters are
trained; the base goes to the Trainer as ``frozen_params`` (an input of the step, sharded like
params, without gradient or optimizer state), and the loss merges the two::

    lora = LoRA(rank=8, alpha=16)                    # default targets: attention q and v
    adapters = lora.init(base)
    def loss_fn(rng, state, params, batch, is_training):
        params = lora.merge(state.frozen_params, params)
        logits = state.apply_fn(params, batch["input_ids"])
        ...
    trainer = Trainer(..., params=adapters, frozen_params=base, optimizer=optax.adamw(1e-3))

The merge costs one rank-r matmul per kernel inside the jitted step, and the model is not
rewritten. Export: ``save_pretrained(model, lora.merge(base, trainer.params), folder)`` for a
Hugging Face folder, or :func:`save_adapters` / :func:`load_adapters` for the adapters alone.

As in Hugging Face PEFT, ``rank_pattern`` / ``alpha_pattern`` give some kernels their own rank
or alpha, ``use_rslora`` scales by ``alpha / sqrt(rank)``, ``use_dora`` adds DoRA's magnitude
vector (each output column of ``W + delta`` rescaled to its trained norm), and
``modules_to_save`` / ``bias`` train chosen parameters whole (a head, the biases): ``init`` puts
a copy of each in the adapters and ``merge`` puts the trained copy in place of the base's.
"""

import dataclasses
import json
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from .errors import ConfigError
from .export import SEPARATOR, save_params
from .store.folder_files import file_in_folder, read_json_object
from .validate import tree_keys

# Attention query and value projections of redcoast.models (Llama/OPT q_proj, v_proj; BERT
# query, value; T5 q, v; GPT-2's fused c_attn, which holds q, k and v in one kernel).
DEFAULT_TARGETS = r"(^|/)(q_proj|v_proj|query|value|q|v|c_attn)/kernel$"
A_NAME, B_NAME = "lora_a", "lora_b"
M_NAME = "lora_magnitude"  # DoRA's magnitude vector (PEFT's lora_magnitude_vector)
ADAPTER_KEYS = (A_NAME, B_NAME, M_NAME)
BIAS_MODES = ("none", "all", "lora_only")
CONFIG_FILE, WEIGHTS_FILE = "lora_config.json", "adapters.safetensors"
FORMAT = "redcoast-lora/1"


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Adapters of rank ``rank``, scaled by ``alpha / rank``.

    ``targets``: a regular expression (or a list of them) searched in each parameter's path
    ("layers/0/self_attn/q_proj/kernel"), or a predicate ``(path, leaf) -> bool``.
    A kernel's first ``stack_dims`` axes are stacked copies (e.g. scanned layers, one adapter
    each), the next ``in_dims`` its input, the rest its output (e.g. ``[in, heads, head_dim]``).

    PEFT's options, with PEFT's names: ``rank_pattern`` / ``alpha_pattern`` map regular
    expressions (searched in a kernel's path; the first that matches wins) to that kernel's rank
    or alpha; ``use_rslora`` scales by ``alpha / sqrt(rank)``; ``use_dora`` makes each adapted
    kernel DoRA's ``m * (W + delta) / ||W + delta||`` (norm of each output column over the input
    axes, held constant for the gradient as PEFT does); ``modules_to_save`` (regular
    expressions searched in parameter paths, e.g. ``r"^score/"``) and ``bias`` (``"all"``: every
    parameter with "bias" in its path; ``"lora_only"``: the biases beside adapted kernels) name
    parameters trained whole.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: Any = DEFAULT_TARGETS
    in_dims: int = 1
    stack_dims: int = 0
    rank_pattern: dict = dataclasses.field(default_factory=dict)
    alpha_pattern: dict = dataclasses.field(default_factory=dict)
    use_rslora: bool = False
    use_dora: bool = False
    modules_to_save: Any = None
    bias: str = "none"

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"LoRA rank={self.rank!r}; it must be a positive integer.")
        if self.bias not in BIAS_MODES:
            raise ConfigError(f"LoRA bias={self.bias!r}; it is one of {BIAS_MODES} (as PEFT's). "
                              "Fix: bias='none' to train no bias, 'all' or 'lora_only'.")
        for name, table, ok in (("rank_pattern", self.rank_pattern, _is_rank),
                                ("alpha_pattern", self.alpha_pattern, _is_number)):
            if not isinstance(table, dict):
                raise ConfigError(f"LoRA {name}={table!r}; it is a dict {{regex: value}}. Fix: "
                                  f"{name}={{'q_proj/kernel$': 4}}, say.")
            for pattern, value in table.items():
                _compiled_pattern(pattern, f"LoRA {name} key")
                if not ok(value):
                    raise ConfigError(f"LoRA {name}[{pattern!r}]={value!r}; it is a "
                                      f"{'positive integer' if ok is _is_rank else 'number'}. "
                                      f"Fix: give each pattern of {name} a valid value.")
        for pattern in _patterns(self.modules_to_save):
            _compiled_pattern(pattern, "LoRA modules_to_save")

    @property
    def scale(self):
        """The scale of a kernel that no pattern names."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def rank_of(self, path):
        """The rank of the adapter of the kernel at ``path`` (a tuple of keys or a str)."""
        return _first_match(self.rank_pattern, _as_str(path), self.rank)

    def alpha_of(self, path):
        return _first_match(self.alpha_pattern, _as_str(path), self.alpha)

    def scale_of(self, path):
        """``alpha / rank`` of the kernel at ``path`` (``alpha / sqrt(rank)`` with rsLoRA)."""
        rank = self.rank_of(path)
        return self.alpha_of(path) / (math.sqrt(rank) if self.use_rslora else rank)

    def in_modules_to_save(self, path):
        """Whether ``modules_to_save`` names the parameter at ``path``."""
        return any(re.search(p, _as_str(path)) for p in _patterns(self.modules_to_save))

    def trains_whole(self, path, adapted_modules=()):
        """Whether the parameter at ``path`` is trained whole: ``modules_to_save`` matches it,
        or it is a bias that ``bias`` trains (``adapted_modules``: the paths of the modules
        holding an adapted kernel, a set of key tuples, for ``"lora_only"``)."""
        if self.in_modules_to_save(path):
            return True
        if self.bias == "all":
            return "bias" in _as_str(path)
        return (self.bias == "lora_only" and "bias" in str(path[-1])
                and tuple(path[:-1]) in adapted_modules)

    def selected(self, params):
        """The paths of the kernels of ``params`` that get adapters: tuples of the tree's own
        keys (str, or int for a list or an int-keyed dict such as ``nnx.to_pure_dict`` gives)."""
        _check_base(params, "LoRA.init")
        if callable(self.targets):
            chosen = lambda path, leaf: self.targets(path_str(path), leaf)  # noqa: E731
        else:
            patterns = [self.targets] if isinstance(self.targets, str) else list(self.targets)
            compiled = [re.compile(p) for p in patterns]
            chosen = lambda path, leaf: any(c.search(path_str(path)) for c in compiled)  # noqa: E731
        leaves = tree_paths(params)
        paths = [p for p, leaf in leaves if chosen(p, leaf)]
        if not paths:
            names = [path_str(p) for p, _ in leaves][:8]
            raise ConfigError(f"LoRA targets {self.targets!r} match no parameter (some paths: "
                              f"{names}). Fix: pass targets= a regex or predicate that matches "
                              "the kernels to adapt.")
        for p in paths:
            shape = np.shape(_get(params, p))
            if len(shape) < self.stack_dims + self.in_dims + 1:
                raise ConfigError(
                    f"LoRA target {path_str(p)} has shape {shape}: too few axes for "
                    f"stack_dims={self.stack_dims} + in_dims={self.in_dims} + an output axis. "
                    "Fix: target matmul kernels only, or set in_dims/stack_dims.")
            _, fan_in, out = self._split(shape)
            rank = self.rank_of(p)
            if rank > min(math.prod(fan_in), math.prod(out)):
                raise ConfigError(
                    f"LoRA rank={rank} exceeds the dimensions of {path_str(p)} (input "
                    f"{math.prod(fan_in)}, output {math.prod(out)}, shape {shape}): A @ B of that "
                    "rank is no low-rank update, and trains more numbers than the kernel has. Fix: "
                    f"a rank of at most {min(math.prod(fan_in), math.prod(out))}, or targets that "
                    "leave this kernel out.")
        return paths

    def whole(self, params, kernels=None):
        """The paths of the parameters of ``params`` trained whole (``modules_to_save``,
        ``bias``); ``kernels``: the adapted kernels (default: :meth:`selected`)."""
        kernels = self.selected(params) if kernels is None else kernels
        modules = {k[:-1] for k in kernels}
        paths = [p for p, _ in tree_paths(params) if self.trains_whole(p, modules)]
        both = sorted(path_str(p) for p in set(paths) & set(kernels))
        if both:
            raise ConfigError(f"LoRA: {both[:4]} are both adapted (targets) and trained whole "
                              "(modules_to_save or bias). Fix: leave them out of one of the two.")
        return paths

    def init(self, params, seed=0):
        """Adapters for ``params``: a tree holding, at each targeted kernel's path, a dict
        ``{"lora_a": A, "lora_b": B}`` in the kernel's dtype; ``B`` is zero, ``A`` uniform in
        ``+-1/sqrt(fan_in)`` (as Hugging Face PEFT initialises it). With ``use_dora`` the dict
        also holds ``"lora_magnitude"``, the norm of each output column of the kernel; the
        parameters trained whole are copied in at their paths."""
        kernels = self.selected(params)
        whole = self.whole(params, kernels)
        shapes = {}
        for path in kernels:
            kernel = _get(params, path)
            shapes[path] = self._split(np.shape(kernel)) + (jnp.dtype(kernel.dtype),)
        dora_kernels = [_get(params, p) for p in kernels] if self.use_dora else []
        copies = [_get(params, p) for p in whole]

        # A of the i-th kernel: uniform(fold_in(key(seed), i), its shape, +-bound), drawn for all
        # kernels of one shape and bound at once (vmapped over i, the same numbers): one random
        # generator per group in the program, not per kernel. XLA:GPU compiled 210 generators
        # (SmolLM2's 30 layers x 7 targets) in 23 s for an H100, the two groups in 0.9 s
        groups: dict = {}
        for i, (path, (stack, fan_in, out, dtype)) in enumerate(shapes.items()):
            a_shape = (*stack, *fan_in, self.rank_of(path))
            groups.setdefault((a_shape, 1.0 / math.sqrt(math.prod(fan_in))), []).append((i, path))

        def drawn(key):
            a_of = {}
            for (a_shape, bound), members in groups.items():
                keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(
                    jnp.asarray([i for i, _ in members], jnp.uint32))
                a = jax.vmap(lambda k, a_shape=a_shape, bound=bound: jax.random.uniform(
                    k, a_shape, jnp.float32, -bound, bound))(keys)
                a_of.update({path: a[j] for j, (_, path) in enumerate(members)})
            return a_of

        def make(dora_kernels, copies):  # one compiled program, not one dispatch per array
            adapters, a_of = {}, drawn(jax.random.PRNGKey(seed))
            for i, (path, (stack, fan_in, out, dtype)) in enumerate(shapes.items()):
                rank = self.rank_of(path)
                pair = {A_NAME: a_of[path].astype(dtype),
                        B_NAME: jnp.zeros((*stack, rank, *out), dtype)}
                if self.use_dora:
                    w = jnp.asarray(dora_kernels[i], jnp.float32)
                    axes = tuple(range(len(stack), len(stack) + len(fan_in)))
                    pair[M_NAME] = jnp.linalg.norm(w, axis=axes).astype(dtype)
                _set(adapters, path, pair)
            for path, leaf in zip(whole, copies):
                _set(adapters, path, jnp.array(leaf, copy=True))
            return adapters
        return jax.jit(make)(dora_kernels, copies)

    def delta(self, a, b, path=None):
        """``alpha / rank * A @ B`` in the kernel's shape (float32 accumulation); ``path``
        picks the kernel's own scale where patterns give one."""
        scale = self.scale if path is None else self.scale_of(path)
        return _delta(scale, self.stack_dims, a, b)

    def merge(self, base, adapters):
        """``base`` with each adapted kernel replaced by ``W + alpha / rank * A @ B`` (in W's
        dtype; with DoRA, that rescaled column by column to the trained magnitude) and each
        parameter trained whole by its trained copy; traceable, so a loss calls it inside the
        jitted step. Called outside one (e.g. to export), it runs as one compiled program and
        each merged kernel keeps its kernel's sharding.

        ``adapters`` must hold what :meth:`init` makes: any other leaf would be ignored (never
        trained), so it is refused; see the error for a trainable head."""
        if base is None:
            raise ConfigError(
                "lora.merge got base=None. In a loss_fn, state.frozen_params is None when the "
                "Trainer was given no frozen_params. Fix: Trainer(..., params=lora.init(base), "
                "frozen_params=base), and lora.merge(state.frozen_params, params) in the loss.")
        _check_base(base, "lora.merge")
        whole = check_adapters(adapters, self)
        paths = adapter_paths(adapters)
        kernels, pairs, scales = [], [], []
        for path in paths:
            pair = _get(adapters, path)
            kernel = _base_leaf(base, path, "LoRA adapter")
            shape = _delta_shape(self.stack_dims, np.shape(pair[A_NAME]), np.shape(pair[B_NAME]))
            if shape != np.shape(kernel):
                raise ConfigError(f"LoRA adapter {path_str(path)} makes shape {shape}; the "
                                  f"kernel is {np.shape(kernel)}. Fix: load adapters made for "
                                  "this model (same in_dims/stack_dims).")
            check_pair(self, path, pair, shape)
            kernels.append(kernel)
            pairs.append((pair[A_NAME], pair[B_NAME], pair.get(M_NAME)))
            scales.append(self.scale_of(path))
        for path in whole:
            trained, kernel = _get(adapters, path), _base_leaf(base, path, "trained parameter")
            if np.shape(trained) != np.shape(kernel):
                raise ConfigError(f"the trained parameter {path_str(path)} has shape "
                                  f"{np.shape(trained)}; the base's is {np.shape(kernel)}. Fix: "
                                  "merge adapters into the model they were made for.")
        if _traced(kernels, pairs):
            merged_kernels = _merged_kernels(tuple(scales), self.stack_dims,
                                             (None,) * len(kernels), kernels, pairs)
        else:
            # One program for all kernels, not one per operation per kernel: with FSDP-sharded
            # adapters those small programs' collectives crossed the processes and two
            # processes hung (CPUs, jax 0.10: 5 of 5 runs; placement.py has the same hazard)
            shardings = tuple(k.sharding if isinstance(getattr(k, "sharding", None), NamedSharding)
                              else None for k in kernels)
            merged_kernels = _merged_kernels_jit(tuple(scales), self.stack_dims, shardings,
                                                 kernels, pairs)
        merged = base
        for path, kernel in zip(paths, merged_kernels):
            merged = _replace(merged, path, kernel)
        for path in whole:
            merged = _replace(merged, path, _get(adapters, path))
        return merged

    def _split(self, shape):
        s, i = self.stack_dims, self.in_dims
        return shape[:s], shape[s:s + i], shape[s + i:]


def _is_rank(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _patterns(value):
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _compiled_pattern(pattern, what):
    try:
        return re.compile(pattern)
    except (re.error, TypeError) as e:
        raise ConfigError(f"{what} {pattern!r} is no regular expression ({e}). Fix: a "
                          "regular expression searched in parameter paths, e.g. "
                          "'q_proj/kernel$'.") from None


def _first_match(table, text, default):
    return next((value for pattern, value in table.items() if re.search(pattern, text)), default)


def _as_str(path):
    return path if isinstance(path, str) else path_str(path)


def _base_leaf(base, path, what):
    try:
        return _get(base, path)
    except (KeyError, IndexError, TypeError):
        raise ConfigError(f"{what} {path_str(path)} has no counterpart in the base params. Fix: "
                          "merge adapters into the model they were made for.") from None


def check_pair(lora, path, pair, kernel_shape):
    """The pair's rank is the one ``lora`` gives its kernel, and it holds DoRA's magnitude
    (of the kernel's stack and output shape) exactly when ``lora.use_dora``."""
    rank = np.shape(pair[A_NAME])[-1]
    if rank != lora.rank_of(path):
        raise ConfigError(f"LoRA adapter {path_str(path)} has rank {rank}; the LoRA gives that "
                          f"kernel rank {lora.rank_of(path)} (its scale alpha / rank depends on "
                          "it). Fix: the LoRA the adapters were made with (rank, rank_pattern).")
    if lora.use_dora != (M_NAME in pair):
        raise ConfigError(
            f"LoRA adapter {path_str(path)} " + ("lacks" if lora.use_dora else "holds") +
            f" DoRA's {M_NAME!r} while the LoRA has use_dora={lora.use_dora}. Fix: the LoRA "
            "the adapters were made with (use_dora).")
    if lora.use_dora:
        s = lora.stack_dims
        want = tuple(kernel_shape[:s]) + tuple(kernel_shape[np.ndim(pair[A_NAME]) - 1:])
        if np.shape(pair[M_NAME]) != want:
            raise ConfigError(f"LoRA adapter {path_str(path)} has a magnitude of shape "
                              f"{np.shape(pair[M_NAME])}, not the kernel's output shape {want}. "
                              "Fix: load adapters made for this model.")


def _delta(scale, stack_dims, a, b):
    s = stack_dims
    stack, fan_in, rank = a.shape[:s], a.shape[s:-1], a.shape[-1]
    out = b.shape[s + 1:]
    a2 = a.reshape(*stack, math.prod(fan_in), rank)
    b2 = b.reshape(*stack, rank, math.prod(out))
    d = jnp.matmul(a2, b2, preferred_element_type=jnp.float32)
    return (scale * d).reshape(*stack, *fan_in, *out)


def _delta_shape(stack_dims, a_shape, b_shape):
    return tuple(a_shape[:-1]) + tuple(b_shape[stack_dims + 1:])


def _merged_kernels(scales, stack_dims, shardings, kernels, pairs):
    """Each ``W + scale * A @ B`` in W's dtype (with DoRA's magnitude, each output column of it
    rescaled to the magnitude), placed on its sharding where one is given."""
    merged = []
    for kernel, (a, b, m), scale, sharding in zip(kernels, pairs, scales, shardings):
        w = jnp.asarray(kernel, jnp.float32) + _delta(scale, stack_dims, a, b)
        if m is not None:
            axes = tuple(range(stack_dims, a.ndim - 1))  # the input axes
            # PEFT detaches the norm (DoRA's paper, section 4.3): no gradient through it
            norm = jax.lax.stop_gradient(jnp.linalg.norm(w, axis=axes, keepdims=True))
            w = w * (jnp.expand_dims(jnp.asarray(m, jnp.float32), axes) / norm)
        w = w.astype(kernel.dtype)
        merged.append(w if sharding is None else jax.lax.with_sharding_constraint(w, sharding))
    return merged


_merged_kernels_jit = jax.jit(_merged_kernels, static_argnums=(0, 1, 2))


def _traced(*trees) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(trees))


def adapter_paths(adapters):
    """The kernel paths of an adapter tree (each holds ``lora_a`` and ``lora_b``), as tuples of
    the tree's own keys, in the tree's flatten order."""
    return list(dict.fromkeys(p[:-1] for p, _ in tree_paths(adapters) if p[-1] in (A_NAME, B_NAME)))


def tree_paths(tree):
    """``[(path, leaf)]`` in flatten order, each path a tuple of the tree's own keys (a dict's
    keys as they are, a list's int indices), so that ``_get(tree, path)`` finds the leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(_raw_key(k) for k in kp), leaf) for kp, leaf in flat]


def path_str(path):
    """'layers/0/self_attn/q_proj/kernel' for a path of any keys."""
    return "/".join(str(k) for k in path)


def _raw_key(key):
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


TRAINABLE_HEAD_RECIPE = (
    "To train a head (or any other parameter) whole beside the adapters, name it in the LoRA: "
    "LoRA(..., modules_to_save=r'^head/') (PEFT's option; bias='all' or 'lora_only' trains "
    "biases), and lora.init puts a copy of it in the adapters. Or keep the two apart and put the "
    "head back after the merge:\n"
    "    params = {'adapters': lora.init(base), 'head': base['head']}\n"
    "    def loss_fn(rng, state, params, batch, is_training):\n"
    "        merged = lora.merge(state.frozen_params, params['adapters'])\n"
    "        merged = {**merged, 'head': params['head']}   # the trained head replaces the base's\n"
    "        ...")


def check_adapters(adapters, lora=None):
    """The paths of the parameters ``adapters`` holds whole (those ``lora`` trains whole);
    every other leaf is part of a complete ``{lora_a, lora_b[, lora_magnitude]}`` adapter."""
    leaves = tree_paths(adapters)
    kernels = adapter_paths(adapters)
    modules = {k[:-1] for k in kernels}
    whole = [p for p, _ in leaves if p[-1] not in ADAPTER_KEYS
             and lora is not None and lora.trains_whole(p, modules)]
    kept = set(whole)
    stray = [p for p, _ in leaves if p[-1] not in ADAPTER_KEYS and p not in kept]
    if stray:
        shown = ", ".join(path_str(p) for p in stray[:5]) + (" ..." if len(stray) > 5 else "")
        whole_tree = (" None of its leaves is an adapter: was the full base passed as the "
                      "trainable params?" if len(stray) == len(leaves) else "")
        raise ConfigError(
            f"lora.merge was given adapters holding {len(stray)} leaves that are not LoRA pairs "
            f"nor parameters the LoRA trains whole ({shown}).{whole_tree} merge would ignore "
            "them: they would get a zero gradient and never train. Fix: pass the adapters alone "
            "(as lora.init makes them), params=lora.init(base), frozen_params=base. "
            + TRAINABLE_HEAD_RECIPE)
    for path in kernels:
        pair = _get(adapters, path)
        if (not isinstance(pair, dict) or not {A_NAME, B_NAME} <= set(pair)
                or not set(pair) <= set(ADAPTER_KEYS)):
            raise ConfigError(
                f"LoRA adapter {path_str(path)} holds {sorted(map(str, pair))}, not the pair "
                f"{A_NAME!r}, {B_NAME!r} (and DoRA's {M_NAME!r}). Fix: pass adapters as "
                "lora.init or load_adapters make them.")
    return whole


def _check_base(base, who):
    tree_keys("params", base)
    if base is None or not jax.tree_util.tree_leaves(base):
        raise ConfigError(f"{who} got base params {base!r}, with no arrays. Fix: pass the model's "
                          "params (the frozen base).")


def count(tree):
    """Number of scalars in a tree of arrays (e.g. to report the trainable fraction)."""
    return sum(int(np.prod(np.shape(x))) for x in jax.tree_util.tree_leaves(tree))


def save_adapters(lora, adapters, directory):
    """Write ``adapters`` alone: ``adapters.safetensors`` (tensor names like
    ``layers.0.self_attn.q_proj.kernel.lora_a``) and ``lora_config.json`` (rank, alpha, axes,
    PEFT's options, the adapted kernels and the parameters trained whole). Call on every
    process; process 0 writes."""
    paths = adapter_paths(adapters)
    whole = check_adapters(adapters, lora)
    targets, saved = lora.targets, lora.modules_to_save
    config = {"format": FORMAT, "rank": lora.rank, "alpha": lora.alpha, "in_dims": lora.in_dims,
              "stack_dims": lora.stack_dims,
              "targets": targets if isinstance(targets, (str, list, tuple)) else None,
              "rank_pattern": lora.rank_pattern, "alpha_pattern": lora.alpha_pattern,
              "use_rslora": lora.use_rslora, "use_dora": lora.use_dora,
              "modules_to_save": saved if saved is None or isinstance(saved, str) else list(saved),
              "bias": lora.bias, "kernels": [list(p) for p in paths],
              "whole": [list(p) for p in whole]}
    os.makedirs(directory, exist_ok=True)
    save_params(adapters, os.path.join(directory, WEIGHTS_FILE))
    if jax.process_index() == 0:
        tmp = os.path.join(directory, CONFIG_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(config, f, indent=1)
        os.replace(tmp, os.path.join(directory, CONFIG_FILE))


def load_adapters(directory):
    """``(lora, adapters)`` from a folder written by :func:`save_adapters` (numpy arrays;
    ``lora.merge`` or the Trainer places them)."""
    config_path = file_in_folder(directory, CONFIG_FILE, "the adapters' config")
    if not os.path.exists(config_path):
        raise ConfigError(f"{directory} has no {CONFIG_FILE}. Fix: pass a folder written by "
                          "redcoast.lora.save_adapters.")
    config = read_json_object(config_path, "save the adapters again (save_adapters)")
    if config.get("format") != FORMAT:
        raise ConfigError(f"{config_path} is of format {config.get('format')!r}, not {FORMAT!r}. "
                          "Fix: pass a folder written by redcoast.lora.save_adapters.")
    missing = [k for k in ("rank", "alpha", "in_dims", "stack_dims", "kernels") if k not in config]
    kernels, whole = config.get("kernels"), config.get("whole", [])
    if missing or not all(isinstance(x, list) and all(isinstance(k, list) for k in x)
                          for x in (kernels, whole)):
        raise ConfigError(f"{config_path} lacks {missing or 'kernels as lists of keys'}, which "
                          "save_adapters writes. Fix: save the adapters again (save_adapters).")
    tensors = read_safetensors(file_in_folder(directory, WEIGHTS_FILE, "the adapters' weights"),
                               "save the adapters again (save_adapters)")
    targets, saved = config.get("targets"), config.get("modules_to_save")
    lora = LoRA(rank=config["rank"], alpha=config["alpha"], in_dims=config["in_dims"],
                stack_dims=config["stack_dims"],
                targets=tuple(targets) if isinstance(targets, list) else targets or DEFAULT_TARGETS,
                rank_pattern=config.get("rank_pattern", {}),
                alpha_pattern=config.get("alpha_pattern", {}),
                use_rslora=bool(config.get("use_rslora")), use_dora=bool(config.get("use_dora")),
                modules_to_save=tuple(saved) if isinstance(saved, list) else saved,
                bias=config.get("bias", "none"))
    adapters, expected = {}, set()
    keys = (A_NAME, B_NAME, M_NAME) if lora.use_dora else (A_NAME, B_NAME)
    for path in map(tuple, kernels):
        names = [SEPARATOR.join(str(k) for k in path + (n,)) for n in keys]
        _need(tensors, names, directory)
        expected.update(names)
        _set(adapters, path, {k: tensors[n] for k, n in zip(keys, names)})
    for path in map(tuple, whole):
        name = SEPARATOR.join(str(k) for k in path)
        _need(tensors, [name], directory)
        expected.add(name)
        _set(adapters, path, tensors[name])
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise ConfigError(f"{directory}/{WEIGHTS_FILE} holds tensors that {CONFIG_FILE} does not "
                          f"list: {unexpected[:5]}. Fix: save the adapters again.")
    return lora, adapters


def _need(tensors, names, directory):
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ConfigError(f"{directory}/{WEIGHTS_FILE} lacks {missing}, which "
                          f"{CONFIG_FILE} lists. Fix: save the adapters again.")


def read_safetensors(path, fix):
    """All tensors of the safetensors file ``path`` (numpy), or a clear error naming it."""
    from .store.safetensors_check import load_safetensors

    return load_safetensors(path, fix)


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _replace(tree, path, value):
    """``tree`` with ``value`` at ``path``: the dicts, lists and tuples along the path copied,
    everything else shared, so a merge never changes its input."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(tree, dict):
        return {**tree, key: _replace(tree[key], rest, value)}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        items = list(tree)
        items[key] = _replace(items[key], rest, value)
        return type(tree)(items)
    raise ConfigError(f"lora.merge cannot set a kernel inside a {type(tree).__name__} (at key "
                      f"{key!r}). Fix: pass params as nested dicts or lists (e.g. "
                      "nnx.to_pure_dict(state)).")
