"""What the function being traced is laid out for.

redcoast traces the user's loss or forward (for the plan, for the compiled step) inside
:func:`laid_out_for`. A model cannot be handed these facts through the user's ``loss_fn``, so it
reads them at trace time:

- :func:`model_shards`: how many model shards the program will be split over. redcoast's own
  attention repeats K/V heads when there are more shards than KV heads. Outside redcoast's
  tracing it is 1.
- :func:`vendor_kernels`: whether the program may call vendor kernels (cuDNN's fused attention).
  The data-flow analysis traces with False: it follows standard operations, so a model writes
  the same computation with XLA's operations there. Outside redcoast's tracing it is True.
- :func:`layout_mesh`: the mesh the program is laid out on, for a vendor kernel whose
  partitioner asks more of its operands than XLA's propagation ensures (cuDNN's attention: query,
  key and value split alike). Outside redcoast's tracing it is None.
"""

import contextlib
import contextvars
import functools

_MODEL_SHARDS = contextvars.ContextVar("redcoast_model_shards", default=1)
_VENDOR_KERNELS = contextvars.ContextVar("redcoast_vendor_kernels", default=True)
_MESH = contextvars.ContextVar("redcoast_mesh", default=None)


def model_shards():
    """The number of model shards the function now being traced is laid out for (default 1)."""
    return _MODEL_SHARDS.get()


def vendor_kernels():
    """Whether the function now being traced may call vendor kernels (default True)."""
    return _VENDOR_KERNELS.get()


def layout_mesh():
    """The mesh the function now being traced is laid out on, or None."""
    return _MESH.get()


@contextlib.contextmanager
def tracing_for(n_model_shards, vendor_kernels=True, mesh=None):
    """Within this block, :func:`model_shards` returns ``n_model_shards``,
    :func:`vendor_kernels` ``vendor_kernels`` and :func:`layout_mesh` ``mesh``."""
    tokens = (_MODEL_SHARDS.set(int(n_model_shards)), _VENDOR_KERNELS.set(bool(vendor_kernels)),
              _MESH.set(mesh))
    try:
        yield
    finally:
        _MESH.reset(tokens[2])
        _VENDOR_KERNELS.reset(tokens[1])
        _MODEL_SHARDS.reset(tokens[0])


def laid_out_for(fn, n_model_shards, vendor_kernels=True, mesh=None):
    """``fn``, traced (or run) inside :func:`tracing_for` with these arguments. Vendor kernels
    stay off where the block it is traced in turned them off (the FLOP count traces the whole
    step so: redcoast/layout/flops.py)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with tracing_for(n_model_shards, vendor_kernels and _VENDOR_KERNELS.get(), mesh):
            return fn(*args, **kwargs)
    return wrapped
