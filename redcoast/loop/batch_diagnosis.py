"""What in a batch or in parameters makes a loss NaN in JAX where PyTorch would not.

JAX gives NaN, silently, for what PyTorch ignores or refuses: a label of -100 (PyTorch's
``ignore_index``; ``optax.softmax_cross_entropy_with_integer_labels`` returns NaN for it, and
a mask multiplying it keeps the NaN) and a token id outside the embedding's rows (an
out-of-range gather is filled with NaN). These read the arrays after the fact, where they are
(a few numbers per array reach the host), to say which.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ..multihost.host import to_host


def nan_findings(state, batch=None):
    """What in a train state's parameters and (given) ``batch`` can make its loss NaN: one
    sentence each, or none."""
    findings = params_findings({"params": state.params, "frozen_params": state.frozen_params})
    if batch is not None:
        findings += batch_findings(batch, vocab_size_of(state.apply_fn))
    return findings


def vocab_size_of(apply_fn):
    """The vocabulary size of the model whose bound ``apply`` (or ``__call__``) this is,
    where its config says (redcoast's models, transformers' Flax models); else None."""
    config = getattr(getattr(apply_fn, "__self__", None), "config", None)
    size = getattr(config, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def batch_findings(batch, vocab_size=None):
    """Each array of ``batch`` (a pytree of host or device arrays) that holds NaN or inf, a
    negative integer, or an integer at or above ``vocab_size``: one sentence each."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    # the device arrays read where they are, by one compiled program (not one per array:
    # placement.py says why), its small results copied to every process
    device_stats = iter(to_host(_device_stats([x for _, x in leaves if isinstance(x, jax.Array)])))
    findings = []
    for path, values in leaves:
        bad, low, high = next(device_stats) if isinstance(values, jax.Array) else _stats(np, values)
        name = f"batch{jax.tree_util.keystr(path)}"
        if bad:
            findings.append(f"{name} holds {int(bad)} NaN or inf value(s)")
        if low is not None and low < 0:
            findings.append(f"{name} holds negative values (the smallest {int(low)}"
                            f"{': -100 is PyTorch ignore_index' if low == -100 else ''})")
        if vocab_size is not None and high is not None and high >= vocab_size:
            findings.append(f"{name} holds {int(high)}, at or above the model's vocab_size "
                            f"{vocab_size} (if it holds token ids or labels)")
    return findings


@jax.jit
def _device_stats(arrays):
    return [_stats(jnp, x) for x in arrays]


@jax.jit
def _finite_leaves(params):
    return jax.tree_util.tree_map(
        lambda x: jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.floating) else True,
        params)


def _stats(xnp, x):
    """``(non-finite count, min, max)`` of one array with numpy or jax.numpy (``xnp``)."""
    x = xnp.asarray(x)
    if x.size == 0:
        return (0, None, None)
    if xnp.issubdtype(x.dtype, xnp.floating):
        return (xnp.sum(~xnp.isfinite(x)), None, None)
    if xnp.issubdtype(x.dtype, xnp.integer):
        return (0, xnp.min(x), xnp.max(x))
    return (0, None, None)


def params_findings(params):
    """The parameters that hold NaN or inf: one sentence, or none (read where the arrays
    are, by one compiled program: not one per array, placement.py says why)."""
    finite = to_host(_finite_leaves(params))
    bad = [jax.tree_util.keystr(path)
           for path, ok in jax.tree_util.tree_flatten_with_path(finite)[0] if not ok]
    if not bad:
        return []
    return [f"the parameters hold NaN or inf at {', '.join(bad[:3])}"
            + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")]
