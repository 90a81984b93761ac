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

from .errors import ConfigError
from .export import SEPARATOR, save_params
from .sharding.paths import leaves_with_paths, path_to_str

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
        """The paths (tuples of str) of the kernels of ``params`` that get adapters."""
        if callable(self.targets):
            chosen = lambda path, leaf: self.targets(path_to_str(path), leaf)  # noqa: E731
        else:
            patterns = [self.targets] if isinstance(self.targets, str) else list(self.targets)
            compiled = [re.compile(p) for p in patterns]
            chosen = lambda path, leaf: any(c.search(path_to_str(path)) for c in compiled)  # noqa: E731
        paths = [p for p, leaf in leaves_with_paths(params) if chosen(p, leaf)]
        if not paths:
            names = [path_to_str(p) for p, _ in leaves_with_paths(params)][:8]
            raise ConfigError(f"LoRA targets {self.targets!r} match no parameter (some paths: "
                              f"{names}). Fix: pass targets= a regex or predicate that matches "
                              "the kernels to adapt.")
        for p in paths:
            shape = np.shape(_get(params, p))
            if len(shape) < self.stack_dims + self.in_dims + 1:
                raise ConfigError(
                    f"LoRA target {path_to_str(p)} has shape {shape}: too few axes for "
                    f"stack_dims={self.stack_dims} + in_dims={self.in_dims} + an output axis. "
                    "Fix: target matmul kernels only, or set in_dims/stack_dims.")
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
        s = self.stack_dims
        stack, fan_in, rank = a.shape[:s], a.shape[s:-1], a.shape[-1]
        out = b.shape[s + 1:]
        a2 = a.reshape(*stack, math.prod(fan_in), rank)
        b2 = b.reshape(*stack, rank, math.prod(out))
        d = jnp.matmul(a2, b2, preferred_element_type=jnp.float32)
        return (self.scale * d).reshape(*stack, *fan_in, *out)

    def merge(self, base, adapters):
        """``base`` with each adapted kernel replaced by ``W + alpha / rank * A @ B`` (in W's
        dtype); traceable, so a loss calls it inside the jitted step."""
        merged = _copy_dicts(base)
        for path in adapter_paths(adapters):
            pair = _get(adapters, path)
            try:
                kernel = _get(base, path)
            except KeyError:
                raise ConfigError(f"LoRA adapter {path_to_str(path)} has no kernel in the base "
                                  "params. Fix: merge adapters into the model they were made "
                                  "for.") from None
            d = self.delta(pair[A_NAME], pair[B_NAME])
            if d.shape != np.shape(kernel):
                raise ConfigError(f"LoRA adapter {path_to_str(path)} makes shape {d.shape}; the "
                                  f"kernel is {np.shape(kernel)}. Fix: load adapters made for "
                                  "this model (same in_dims/stack_dims).")
            _set(merged, path, (kernel.astype(jnp.float32) + d).astype(kernel.dtype))
        return merged

    def _split(self, shape):
        s, i = self.stack_dims, self.in_dims
        return shape[:s], shape[s:s + i], shape[s + i:]


def adapter_paths(adapters):
    """The kernel paths of an adapter tree (each holds ``lora_a`` and ``lora_b``)."""
    return sorted({p[:-1] for p, _ in leaves_with_paths(adapters) if p[-1] in (A_NAME, B_NAME)})


def count(tree):
    """Number of scalars in a tree of arrays (e.g. to report the trainable fraction)."""
    return sum(int(np.prod(np.shape(x))) for x in jax.tree_util.tree_leaves(tree))


def save_adapters(lora, adapters, directory):
    """Write ``adapters`` alone: ``adapters.safetensors`` (tensor names like
    ``layers.0.self_attn.q_proj.kernel.lora_a``) and ``lora_config.json`` (rank, alpha, axes,
    the adapted kernels). Call on every process; process 0 writes."""
    paths = adapter_paths(adapters)
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
    from safetensors.numpy import load_file

    config_path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(config_path):
        raise ConfigError(f"{directory} has no {CONFIG_FILE}. Fix: pass a folder written by "
                          "redcoast.lora.save_adapters.")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("format") != FORMAT:
        raise ConfigError(f"{config_path} is of format {config.get('format')!r}, not {FORMAT!r}. "
                          "Fix: pass a folder written by redcoast.lora.save_adapters.")
    tensors = load_file(os.path.join(directory, WEIGHTS_FILE))
    targets = config["targets"]
    lora = LoRA(rank=config["rank"], alpha=config["alpha"], in_dims=config["in_dims"],
                stack_dims=config["stack_dims"],
                targets=tuple(targets) if isinstance(targets, list) else targets or DEFAULT_TARGETS)
    adapters, expected = {}, set()
    for path in map(tuple, config["kernels"]):
        names = [SEPARATOR.join(path + (n,)) for n in (A_NAME, B_NAME)]
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


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _copy_dicts(tree):
    """The nested dicts copied (the arrays shared), so a merge never changes its input."""
    if isinstance(tree, dict):
        return {k: _copy_dicts(v) for k, v in tree.items()}
    return tree
