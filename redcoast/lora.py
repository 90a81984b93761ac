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
from .folder_files import file_in_folder, read_json_object
from .validate import tree_keys

# Attention query and value projections of redcoast.models (Llama/OPT q_proj, v_proj; BERT
# query, value; T5 q, v; GPT-2's fused c_attn, which holds q, k and v in one kernel).
DEFAULT_TARGETS = r"(^|/)(q_proj|v_proj|query|value|q|v|c_attn)/kernel$"
A_NAME, B_NAME = "lora_a", "lora_b"
CONFIG_FILE, WEIGHTS_FILE = "lora_config.json", "adapters.safetensors"
FORMAT = "redcoast-lora/1"


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Adapters of rank ``rank``, scaled by ``alpha / rank``.

    ``targets``: a regular expression (or a list of them) searched in each parameter's path
    ("layers/0/self_attn/q_proj/kernel"), or a predicate ``(path, leaf) -> bool``.
    A kernel's first ``stack_dims`` axes are stacked copies (e.g. scanned layers, one adapter
    each), the next ``in_dims`` its input, the rest its output (e.g. ``[in, heads, head_dim]``).
    """

    rank: int = 8
    alpha: float = 16.0
    targets: Any = DEFAULT_TARGETS
    in_dims: int = 1
    stack_dims: int = 0

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"LoRA rank={self.rank!r}; it must be a positive integer.")

    @property
    def scale(self):
        return self.alpha / self.rank

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
            if self.rank > min(math.prod(fan_in), math.prod(out)):
                raise ConfigError(
                    f"LoRA rank={self.rank} exceeds the dimensions of {path_str(p)} (input "
                    f"{math.prod(fan_in)}, output {math.prod(out)}, shape {shape}): A @ B of that "
                    "rank is no low-rank update, and trains more numbers than the kernel has. Fix: "
                    f"a rank of at most {min(math.prod(fan_in), math.prod(out))}, or targets that "
                    "leave this kernel out.")
        return paths

    def init(self, params, seed=0):
        """Adapters for ``params``: a tree holding, at each targeted kernel's path, a dict
        ``{"lora_a": A, "lora_b": B}`` in the kernel's dtype; ``B`` is zero, ``A`` uniform in
        ``+-1/sqrt(fan_in)`` (as Hugging Face PEFT initialises it)."""
        shapes = {}
        for path in self.selected(params):
            kernel = _get(params, path)
            shapes[path] = self._split(np.shape(kernel)) + (jnp.dtype(kernel.dtype),)

        def make():  # one compiled program, not one dispatch per array
            adapters, key = {}, jax.random.PRNGKey(seed)
            for i, (path, (stack, fan_in, out, dtype)) in enumerate(shapes.items()):
                bound = 1.0 / math.sqrt(math.prod(fan_in))
                a = jax.random.uniform(jax.random.fold_in(key, i), (*stack, *fan_in, self.rank),
                                       jnp.float32, -bound, bound)
                _set(adapters, path, {A_NAME: a.astype(dtype),
                                      B_NAME: jnp.zeros((*stack, self.rank, *out), dtype)})
            return adapters
        return jax.jit(make)()

    def delta(self, a, b):
        """``alpha / rank * A @ B`` in the kernel's shape (float32 accumulation)."""
        return _delta(self.scale, self.stack_dims, a, b)

    def merge(self, base, adapters):
        """``base`` with each adapted kernel replaced by ``W + alpha / rank * A @ B`` (in W's
        dtype); traceable, so a loss calls it inside the jitted step. Called outside one (e.g.
        to export), it runs as one compiled program and each merged kernel keeps its kernel's
        sharding.

        ``adapters`` must hold LoRA pairs only (as :meth:`init` makes them): any other leaf
        would be ignored (never trained), so it is refused; see the error for a trainable head."""
        if base is None:
            raise ConfigError(
                "lora.merge got base=None. In a loss_fn, state.frozen_params is None when the "
                "Trainer was given no frozen_params. Fix: Trainer(..., params=lora.init(base), "
                "frozen_params=base), and lora.merge(state.frozen_params, params) in the loss.")
        _check_base(base, "lora.merge")
        _check_pairs(adapters)
        paths = adapter_paths(adapters)
        kernels, pairs = [], []
        for path in paths:
            pair = _get(adapters, path)
            try:
                kernel = _get(base, path)
            except (KeyError, IndexError, TypeError):
                raise ConfigError(f"LoRA adapter {path_str(path)} has no kernel in the base "
                                  "params. Fix: merge adapters into the model they were made "
                                  "for.") from None
            shape = _delta_shape(self.stack_dims, np.shape(pair[A_NAME]), np.shape(pair[B_NAME]))
            if shape != np.shape(kernel):
                raise ConfigError(f"LoRA adapter {path_str(path)} makes shape {shape}; the "
                                  f"kernel is {np.shape(kernel)}. Fix: load adapters made for "
                                  "this model (same in_dims/stack_dims).")
            kernels.append(kernel)
            pairs.append((pair[A_NAME], pair[B_NAME]))
        if _traced(kernels, pairs):
            merged_kernels = _merged_kernels(self.scale, self.stack_dims, (None,) * len(kernels),
                                             kernels, pairs)
        else:
            # One program for all kernels, not one per operation per kernel: with FSDP-sharded
            # adapters those small programs' collectives crossed the processes and two
            # processes hung (CPUs, jax 0.10: 5 of 5 runs; placement.py has the same hazard)
            shardings = tuple(k.sharding if isinstance(getattr(k, "sharding", None), NamedSharding)
                              else None for k in kernels)
            merged_kernels = _merged_kernels_jit(self.scale, self.stack_dims, shardings, kernels,
                                                 pairs)
        merged = base
        for path, kernel in zip(paths, merged_kernels):
            merged = _replace(merged, path, kernel)
        return merged

    def _split(self, shape):
        s, i = self.stack_dims, self.in_dims
        return shape[:s], shape[s:s + i], shape[s + i:]


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


def _merged_kernels(scale, stack_dims, shardings, kernels, pairs):
    """Each ``W + scale * A @ B`` in W's dtype, placed on its sharding where one is given."""
    merged = []
    for kernel, (a, b), sharding in zip(kernels, pairs, shardings):
        w = jnp.asarray(kernel, jnp.float32) + _delta(scale, stack_dims, a, b)
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
    "To train a head (or any other parameter) whole beside the adapters, keep the two apart and "
    "put the head back after the merge:\n"
    "    params = {'adapters': lora.init(base), 'head': base['head']}\n"
    "    def loss_fn(rng, state, params, batch, is_training):\n"
    "        merged = lora.merge(state.frozen_params, params['adapters'])\n"
    "        merged = {**merged, 'head': params['head']}   # the trained head replaces the base's\n"
    "        ...")


def _check_pairs(adapters):
    """Every leaf of ``adapters`` is half of a complete ``{lora_a, lora_b}`` pair."""
    leaves = tree_paths(adapters)
    stray = [p for p, _ in leaves if p[-1] not in (A_NAME, B_NAME)]
    if stray:
        shown = ", ".join(path_str(p) for p in stray[:5]) + (" ..." if len(stray) > 5 else "")
        whole = (" None of its leaves is an adapter: was the full base passed as the trainable "
                 "params?" if len(stray) == len(leaves) else "")
        raise ConfigError(
            f"lora.merge was given adapters holding {len(stray)} leaves that are not LoRA pairs "
            f"({shown}).{whole} merge applies lora_a/lora_b pairs only: these would be ignored, "
            "get a zero gradient and never train. Fix: pass the adapters alone (as lora.init "
            "makes them), params=lora.init(base), frozen_params=base. " + TRAINABLE_HEAD_RECIPE)
    for path in adapter_paths(adapters):
        pair = _get(adapters, path)
        if not isinstance(pair, dict) or set(pair) != {A_NAME, B_NAME}:
            raise ConfigError(
                f"LoRA adapter {path_str(path)} holds {sorted(map(str, pair))}, not the pair "
                f"{A_NAME!r}, {B_NAME!r}. Fix: pass adapters as lora.init or load_adapters make them.")


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
    the adapted kernels). Call on every process; process 0 writes."""
    paths = adapter_paths(adapters)
    _check_pairs(adapters)
    config = {"format": FORMAT, "rank": lora.rank, "alpha": lora.alpha, "in_dims": lora.in_dims,
              "stack_dims": lora.stack_dims,
              "targets": lora.targets if isinstance(lora.targets, (str, list, tuple)) else None,
              "kernels": [list(p) for p in paths]}
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
    kernels = config.get("kernels")
    if missing or not (isinstance(kernels, list) and all(isinstance(k, list) for k in kernels)):
        raise ConfigError(f"{config_path} lacks {missing or 'kernels as lists of keys'}, which "
                          "save_adapters writes. Fix: save the adapters again (save_adapters).")
    tensors = read_safetensors(file_in_folder(directory, WEIGHTS_FILE, "the adapters' weights"),
                               "save the adapters again (save_adapters)")
    targets = config.get("targets")
    lora = LoRA(rank=config["rank"], alpha=config["alpha"], in_dims=config["in_dims"],
                stack_dims=config["stack_dims"],
                targets=tuple(targets) if isinstance(targets, list) else targets or DEFAULT_TARGETS)
    adapters, expected = {}, set()
    for path in map(tuple, config["kernels"]):
        names = [SEPARATOR.join(str(k) for k in path + (n,)) for n in (A_NAME, B_NAME)]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ConfigError(f"{directory}/{WEIGHTS_FILE} lacks {missing}, which "
                              f"{CONFIG_FILE} lists. Fix: save the adapters again.")
        expected.update(names)
        _set(adapters, path, {A_NAME: tensors[names[0]], B_NAME: tensors[names[1]]})
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise ConfigError(f"{directory}/{WEIGHTS_FILE} holds tensors that {CONFIG_FILE} does not "
                          f"list: {unexpected[:5]}. Fix: save the adapters again.")
    return lora, adapters


def read_safetensors(path, fix):
    """All tensors of the safetensors file ``path`` (numpy), or a clear error naming it."""
    from .safetensors_check import load_safetensors

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
