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
from flax import nnx


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


def run_layers(layers, n_layers, x, cache, call, *, scanned, remat):
    """``(x, new cache)``: ``x`` through the ``n_layers`` layers in order, ``call(layer, x,
    layer_cache) -> (x, layer_cache)`` on each; ``layers`` stacked (``scanned``: run by a
    scan when there is no cache) or a list. ``cache``: ``{"layers": {"0": ..., ...}}`` or None
    (the new cache is then None too)."""
    if scanned and cache is None:
        return scan_layers(layers, x, lambda layer, h: call(layer, h, None)[0], remat), None
    run = nnx.remat(call) if remat else call
    new = {}
    for i in range(n_layers):
        layer = layer_at(layers, i) if scanned else layers[i]
        x, new[str(i)] = run(layer, x, None if cache is None else cache["layers"][str(i)])
    return x, None if cache is None else {"layers": new}
