"""Layers stacked on a leading axis and run with ``jax.lax.scan``: one traced layer, not N.

An unrolled N-layer model traces, partitions and compiles N copies of its layer: an 80-layer
step takes minutes to compile and the TPU compiler gigabytes of host memory. Stored stacked
(every parameter of the layers as one array ``[N, ...]``) and run with a scan, the compiler sees
one layer whatever N is. The parameters keep their names with the layer index gone
(``layers/self_attn/q_proj/kernel`` of shape ``[N, in, out]``); Hugging Face folders still hold
one tensor per layer (:class:`redcoast.models.hf.Stacked` reads and writes them).

Decoding with a KV cache indexes one layer at a time (:func:`layer_at`), so the cache keeps its
per-layer form and beam search reorders it as before.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from . import hf


def stacked_layers(make_layer, n_layers, rngs):
    """``n_layers`` layers made by ``make_layer(rngs)``, held as one module whose parameters
    carry a leading axis of ``n_layers`` (each layer drawn from its own key)."""
    keys = jax.random.split(rngs.params(), n_layers)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: make_layer(nnx.Rngs(0))))

    def one(key):
        return nnx.to_pure_dict(nnx.state(make_layer(nnx.Rngs(params=key)), nnx.Param))

    nnx.replace_by_pure_dict(state, jax.vmap(one)(keys))
    return nnx.merge(graphdef, state)


def scan_layers(layers, x, body, remat=False, xs=None):
    """``x`` through every layer of ``layers`` (from :func:`stacked_layers`) in order:
    ``x = body(layer, x)`` under a scan, or ``body(layer, x, xs_i)`` with ``xs`` (a pytree
    whose leaves have a leading axis of layers: each layer's own inputs); ``remat``: each
    layer's activations recomputed in the backward pass (only the carry between layers is
    kept)."""
    graphdef, state = nnx.split(layers)

    def step(carry, slices):
        layer_state, layer_xs = slices
        layer = nnx.merge(graphdef, layer_state)
        return (body(layer, carry) if xs is None else body(layer, carry, layer_xs)), None

    if remat:  # no CSE barrier needed inside a scan body (the loop keeps the recomputation apart)
        step = jax.checkpoint(step, prevent_cse=False)
    return jax.lax.scan(step, x, (state, xs))[0]


def layer_at(layers, i):
    """Layer ``i`` of ``layers`` (from :func:`stacked_layers`) as a module of its own."""
    graphdef, state = nnx.split(layers)
    return nnx.merge(graphdef, jax.tree_util.tree_map(lambda a: a[i], state))


def make_layers(make_layer, n_layers, rngs, scanned):
    """The ``n_layers`` layers ``make_layer(i, rngs)``: stacked (``scanned``; every layer made
    as layer 0, so a family whose layers differ by index refuses ``scan_layers`` in its config)
    or an ``nnx.List``."""
    if scanned:
        return stacked_layers(lambda r: make_layer(0, r), n_layers, rngs)
    return nnx.List([make_layer(i, rngs) for i in range(n_layers)])


def layer_of(layers, i, scanned):
    """Layer ``i`` of ``layers`` (from :func:`make_layers`) as a module of its own."""
    return layer_at(layers, i) if scanned else layers[i]


def layer_sources(layer_source, n_layers, scanned):
    """The ``hf_sources`` entry of the layers: ``layer_source(i)`` (a tree of
    :class:`redcoast.models.hf.Source`) for each, stacked (``scanned``) or keyed by index."""
    per_layer = [layer_source(i) for i in range(n_layers)]
    if scanned:
        return hf.stack_sources(per_layer)
    return {str(i): tree for i, tree in enumerate(per_layer)}


def run_layers(layers, n_layers, x, cache, call, *, scanned, remat, inputs=None):
    """``(x, new cache)``: ``x`` through the ``n_layers`` layers in order, ``call(layer, x,
    layer_cache) -> (x, layer_cache)`` on each; ``layers`` stacked (``scanned``: run by a
    scan when there is no cache) or a list. ``cache``: ``{"layers": {"0": ..., ...}}`` or None
    (the new cache is then None too). ``inputs``: each layer's own further input in the same
    form (e.g. cross-attention keys and values), passed as ``call``'s fourth argument (scanned
    with the layer: its layers stacked as the scan's ``xs``)."""
    per_layer = (lambda i: ()) if inputs is None else (lambda i: (inputs["layers"][str(i)],))
    if scanned and cache is None:
        xs = None if inputs is None else jax.tree_util.tree_map(
            lambda *a: jnp.stack(a), *[inputs["layers"][str(i)] for i in range(n_layers)])
        body = ((lambda layer, h: call(layer, h, None)[0]) if inputs is None
                else (lambda layer, h, layer_xs: call(layer, h, None, layer_xs)[0]))
        return scan_layers(layers, x, body, remat, xs), None
    run = nnx.remat(call) if remat else call
    new = {}
    for i in range(n_layers):
        x, new[str(i)] = run(layer_of(layers, i, scanned), x,
                             None if cache is None else cache["layers"][str(i)], *per_layer(i))
    return x, None if cache is None else {"layers": new}
