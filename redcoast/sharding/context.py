"""How many model shards the function being traced will run on.

redcoast traces the user's loss or forward (for the plan, for the compiled step) inside
:func:`laid_out_for`; a model may read :func:`model_shards` at trace time to choose the
formulation that splits over that many shards (redcoast's own attention repeats K/V heads when
there are more shards than KV heads). Outside redcoast's tracing it is 1.
"""

import contextlib
import contextvars
import functools

_MODEL_SHARDS = contextvars.ContextVar("redcoast_model_shards", default=1)


def model_shards():
    """The number of model shards the function now being traced is laid out for (default 1)."""
    return _MODEL_SHARDS.get()


@contextlib.contextmanager
def tracing_for(n_model_shards):
    """Within this block, :func:`model_shards` returns ``n_model_shards``."""
    token = _MODEL_SHARDS.set(int(n_model_shards))
    try:
        yield
    finally:
        _MODEL_SHARDS.reset(token)


def laid_out_for(fn, n_model_shards):
    """``fn``, traced (or run) with :func:`model_shards` returning ``n_model_shards``."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with tracing_for(n_model_shards):
            return fn(*args, **kwargs)
    return wrapped
