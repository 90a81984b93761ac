"""Calling user functions as redco 0.4.23 did: by keyword wherever the function names the argument.

redco called ``loss_fn(rng=..., state=..., params=..., batch=..., is_training=...)``,
``pred_fn(rng=..., params=..., batch=...)``, ``collate_fn(examples=...)`` and
``eval_metric_fn(examples=..., preds=...)``, so redco scripts define them in any argument order
(``pred_fn(rng, batch, params)``, ``eval_metric_fn(preds, examples)``). A wrapped function is
called with each argument by keyword when its signature has a parameter of that name, and
positionally (in order, before the keywords) otherwise, so ``loss_fn(train_rng, state, ...)``
works too. A function whose signature cannot take that mix is called positionally.
"""

import functools
import inspect
from collections.abc import Mapping

LOSS_FN_ARGS = ("rng", "state", "params", "batch", "is_training")
PRED_FN_ARGS = ("rng", "params", "batch")
COLLATE_FN_ARGS = ("examples",)
EVAL_METRIC_FN_ARGS = ("examples", "preds")


def _keyword_names(fn, names):
    """The names to pass by keyword, or None when ``fn`` must be called positionally."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C callables have none
        return None
    by_name = {n for n, p in signature.parameters.items()
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
        by_name |= set(names)  # def loss_fn(**kwargs): redco passed every argument by name
    keywords = tuple(n for n in names if n in by_name)
    positional = [object()] * (len(names) - len(keywords))
    try:
        signature.bind(*positional, **{n: None for n in keywords})
    except TypeError:
        return None
    return keywords


def by_keyword(fn, names, copy_batch=False):
    """``fn`` called as redco called it: ``names`` by keyword where ``fn`` has them.

    ``copy_batch`` gives each call its own shallow copy of a dict ``batch``: redco scripts
    ``batch.pop('labels')`` inside ``loss_fn``/``pred_fn``, and redcoast may trace a function
    more than once on one batch (its sharding analysis, then the step).
    """
    if fn is None or getattr(fn, "_redcoast_by_keyword", False):
        return fn
    keywords = _keyword_names(fn, names)
    copies_batch = copy_batch and "batch" in names

    @functools.wraps(fn)
    def call(*args, **kwargs):  # redcoast passes positionally, redco-style code by keyword
        given = dict(zip(names, args), **kwargs)
        if copies_batch and isinstance(given.get("batch"), Mapping):
            given["batch"] = dict(given["batch"])
        if keywords is None:
            return fn(*[given[n] for n in names])
        return fn(*[given[n] for n in names if n not in keywords],
                  **{n: given[n] for n in keywords})

    call._redcoast_by_keyword = True
    return call

