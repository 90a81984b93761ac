"""Checks of user arguments, run before any work, each failing with the cause and the fix."""

import numbers

import jax

from .errors import ConfigError


def is_integer(value):
    """An integer, not a bool (numpy's integers count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(name, value, hint=""):
    """``value`` must be an integer >= 1."""
    if not is_integer(value) or value < 1:
        raise ConfigError(f"{name}={value!r}; it must be a positive integer.{hint}")
    return int(value)


def optional_positive_int(name, value, hint=""):
    """None or 0 (off), or an integer >= 1."""
    if value is None:
        return None
    if not is_integer(value) or value < 0:
        raise ConfigError(f"{name}={value!r}; it must be a positive integer, or None (or 0) for "
                          f"never.{hint}")
    return int(value)


def non_negative_int(name, value):
    if not is_integer(value) or value < 0:
        hint = " (None only with max_steps)" if name == "n_epochs" else ""
        raise ConfigError(f"{name}={value!r}; it must be an integer >= 0{hint}.")
    return int(value)


def non_empty_examples(name, examples):
    """Examples must be a non-empty sequence (len and indexing)."""
    if examples is None:
        return
    try:
        n = len(examples)
    except TypeError:
        return  # not a sized sequence: the data pipeline reports what it accepts
    if n == 0:
        raise ConfigError(f"{name} is empty. Fix: pass at least one example"
                          + (", or eval_examples=None to skip evaluation." if name == "eval_examples"
                             else "."))


def fit_args(per_device_batch_size, n_epochs, eval_examples, eval_per_device_batch_size,
             save_every_n_steps, save_every_k_epochs, keep_last_n_ckpts, log_every_n_steps,
             train_examples, max_steps=None, eval_every_n_steps=None):
    """Every argument of ``Trainer.fit`` that a typo can make wrong, checked before any work."""
    from .store.checkpoint import check_keep_last_n

    positive_int("per_device_batch_size", per_device_batch_size)
    if max_steps is not None:
        positive_int("max_steps", max_steps, " Fix: the number of optimizer updates to train for, "
                     "or None to train for n_epochs.")
    if n_epochs is not None or max_steps is None:
        non_negative_int("n_epochs", n_epochs)
    eval_every = optional_positive_int("eval_every_n_steps", eval_every_n_steps)
    if eval_every and eval_examples is None:
        raise ConfigError(f"eval_every_n_steps={eval_every_n_steps} but eval_examples is None, so "
                          "there is nothing to evaluate. Fix: pass eval_examples=..., or leave "
                          "eval_every_n_steps out.")
    positive_int("log_every_n_steps", log_every_n_steps)
    if eval_per_device_batch_size is not None:
        positive_int("eval_per_device_batch_size", eval_per_device_batch_size)
    optional_positive_int("save_every_n_steps", save_every_n_steps)
    optional_positive_int("save_every_k_epochs", save_every_k_epochs)
    check_keep_last_n(keep_last_n_ckpts)
    non_empty_examples("train_examples", train_examples)
    eval_examples_sequence(eval_examples)
    non_empty_examples("eval_examples", eval_examples)


def eval_examples_sequence(eval_examples):
    """``eval_examples`` is read whole at each evaluation, each example counted once: it must
    have a length and be indexable (a generator would be empty after the first evaluation)."""
    if eval_examples is None or (hasattr(eval_examples, "__len__") and
                                 hasattr(eval_examples, "__getitem__")):
        return
    raise ConfigError(
        f"eval_examples is a {type(eval_examples).__name__}, without len() and indexing; the "
        "evaluation reads all of it after every epoch (every example counted once), so it must be "
        "a sequence. Fix: eval_examples=list(eval_examples), or a datasets.Dataset.")


def trainer_args(collate_fn, loss_fn, optimizer, train_step_fn=None, params=None,
                 frozen_params=None, accumulate_grad_batches=1, eval_by=None):
    """The functions, optimizer, parameter trees and settings given to ``Trainer``."""
    if eval_by not in (None, "example", "batch"):
        raise ConfigError(f"eval_by={eval_by!r}; it must be 'example' (loss_fn applied to one "
                          "example at a time, the exact mean over examples), 'batch' (to whole "
                          "batches: a loss defined over the batch, such as a contrastive one) or "
                          "None (decided at the first evaluation).")
    if not is_integer(accumulate_grad_batches) or accumulate_grad_batches < 1:
        raise ConfigError(f"accumulate_grad_batches={accumulate_grad_batches!r}; it must be a "
                          "positive integer.")
    tree_keys("params", params)
    tree_keys("frozen_params", frozen_params)
    live_arrays("params", params)
    live_arrays("frozen_params", frozen_params)
    if not callable(collate_fn):
        raise ConfigError(f"collate_fn is {type(collate_fn).__name__}, not a function. Fix: pass "
                          "a function from a list of examples to a dict of arrays.")
    if not callable(loss_fn) and not (loss_fn is None and train_step_fn is not None):
        raise ConfigError(f"loss_fn is {type(loss_fn).__name__}, not a function. Fix: pass "
                          "loss_fn(rng, state, params, batch, is_training) -> scalar loss.")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise ConfigError(f"optimizer is {type(optimizer).__name__}, not an optax optimizer. Fix: "
                          "pass an optax.GradientTransformation, e.g. optax.adamw(1e-4).")


def tree_keys(name, tree, _path=""):
    """Every dict of ``tree`` has keys JAX can sort and that name distinct paths (``1`` and
    ``'1'`` both become '1' in paths, checkpoints and exports; JAX cannot sort them at all)."""
    if isinstance(tree, dict):
        keys = list(tree)
        by_name = {}
        for key in keys:
            by_name.setdefault(str(key), []).append(key)
        clash = next((ks for ks in by_name.values() if len(ks) > 1), None)
        types = {type(k) for k in keys}
        if clash or len(types) > 1:
            where = f"{name}{_path}"
            what = (f"keys {clash[0]!r} and {clash[1]!r}, which name the same path "
                    f"'{clash[0]}'" if clash else
                    "keys of types " + " and ".join(sorted(t.__name__ for t in types)) +
                    f" ({', '.join(repr(k) for k in keys[:4])}), which JAX cannot sort")
            raise ConfigError(f"{where} has {what}. Fix: give the dict keys of one type "
                              "(strings), one per entry.")
        for key in keys:
            tree_keys(name, tree[key], f"{_path}[{key!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, child in enumerate(tree):
            tree_keys(name, child, f"{_path}[{i}]")


def live_arrays(name, tree):
    """No array of ``tree`` was deleted: a Trainer's update donates its state, so arrays read
    from ``trainer.params`` (or ``frozen_params``) before an update are gone after it."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ConfigError(
                f"{name}{jax.tree_util.keystr(path)} is an array that was deleted: a Trainer's "
                "update replaces its parameters and frees the ones before (the step donates "
                "them), so a tree read from trainer.params or trainer.frozen_params before an "
                "update is gone after it. Fix: read trainer.params (and trainer.frozen_params) "
                "again at each call, after the updates, or keep a copy "
                "(jax.tree_util.tree_map(jnp.copy, trainer.params)).")


def array_leaves(name, tree):
    """Every leaf of ``tree`` is an array or a number (a Trainer, a model or a string passed as
    parameters would fail deep inside JAX)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")
                or isinstance(leaf, numbers.Number)):
            hint = (" Fix: pass trainer.params (the Trainer's parameters), not the Trainer."
                    if hasattr(leaf, "params") else " Fix: pass a tree of arrays.")
            raise ConfigError(f"{name}{jax.tree_util.keystr(path)} is a {type(leaf).__name__}, "
                              f"not an array.{hint}")
