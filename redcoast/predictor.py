"""Batched, ordered prediction with sharded parameters: one output per example, in input order."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from . import validate
from .data import BatchMaker, global_batch_size, is_sequence, padded_batches, prefetch
from .errors import DataError
from .multihost import placement
from .multihost.heartbeat import heartbeat
from .multihost.host import to_host
from .sharding.axes import DATA_AXIS, MESH_AXES, MODEL_AXIS
from .sharding.context import laid_out_for


class Predictor:
    """Runs ``pred_fn(rng, params, batch)`` over examples on the deployer's mesh.

    ``output_fn`` (optional) turns one batch of host arrays into a list of outputs, e.g.
    ``tokenizer.batch_decode``; without it each example's output is its row of every array.
    """

    def __init__(self, deployer, collate_fn, pred_fn, output_fn=None, params_sharding_rules=None):
        self.deployer = deployer
        self.collate_fn = collate_fn
        self.pred_fn = pred_fn
        self.output_fn = output_fn
        self.params_sharding_rules = params_sharding_rules
        self._compiled = {}  # the params' structure, shapes, dtypes and shardings -> compiled step

    def _placement(self, params):
        """(mesh, storage shardings, shardings where used) for ``params``.

        Without ``params_sharding_rules``, parameters already laid out on one ('dp', 'mp') mesh
        (``trainer.params``, ``from_pretrained(..., deployer)``) stay where they are, on that
        mesh; the step gathers what is stored split over 'dp' (FSDP) where it is used. Anything
        else is placed by a plan from the shapes on the deployer's mesh."""
        if not self.params_sharding_rules:
            mesh = _laid_out_on(params)
            if mesh is not None:
                storage = jax.tree_util.tree_map(lambda x: x.sharding, params)
                used = jax.tree_util.tree_map(
                    lambda x: NamedSharding(mesh, _without_dp(x.sharding.spec))
                    if x.sharding.mesh == mesh else x.sharding, params)
                return mesh, storage, used
        plan = self.deployer.get_sharding_plan(params, self.params_sharding_rules)
        return self.deployer.mesh, plan.param_shardings(), plan.compute_shardings()

    def _step_for(self, params):
        """(mesh, storage shardings, jitted step) for ``params`` (built once per layout of them)."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        key = (treedef, tuple((np.shape(x), str(getattr(x, "dtype", "")),
                               x.sharding if isinstance(x, jax.Array) else None) for x in leaves))
        if key not in self._compiled:
            mesh, shardings, used = self._placement(params)
            pred_fn = laid_out_for(self.pred_fn, mesh.shape[MODEL_AXIS], mesh=mesh)

            def step(p, batch, rng, index):
                # parameters stored split further (FSDP) are gathered where used, not the activations
                p = jax.lax.with_sharding_constraint(p, used)
                return pred_fn(jax.random.fold_in(rng, index), p, batch)

            jitted = jax.jit(step, in_shardings=(shardings, NamedSharding(mesh, P(DATA_AXIS)),
                                                 NamedSharding(mesh, P()), NamedSharding(mesh, P())))
            self._compiled[key] = (mesh, shardings, jitted)
        return self._compiled[key]

    def predict(self, examples, per_device_batch_size, params, desc=None, rng=None):
        """A list with exactly one output per example, in the order of ``examples`` (a
        sequence, or any iterable such as a generator, read into a list first).

        ``pred_fn``'s key for each batch is folded from ``rng``; without one, from a fresh key
        drawn from the deployer on each call (as redco draws one per batch), so that sampling
        twice gives two samples; the same ``rng`` gives the same predictions."""
        if not is_sequence(examples):  # a generator has no len(): the outputs are a list anyway
            examples = list(examples)
        validate.positive_int("per_device_batch_size", per_device_batch_size)
        validate.tree_keys("params", params)
        validate.array_leaves("params", params)
        validate.live_arrays("params", params)
        mesh, shardings, step = self._step_for(params)
        params = placement.device_put(params, shardings)
        rng = self.deployer.gen_rng() if rng is None else rng
        global_batch = global_batch_size(per_device_batch_size, mesh)
        maker = BatchMaker(mesh, self.collate_fn, global_batch)
        batches = prefetch((maker.make(examples, idx), n_real)
                           for idx, n_real in padded_batches(len(examples), global_batch))
        results, in_flight = [], None
        for index, (batch, n_real) in enumerate(batches):
            out = step(params, batch, rng, jnp.int32(index))
            heartbeat()  # redcoast launch's watchdog: this process makes progress
            _check_outputs(out, global_batch)  # shapes only: before waiting for any result
            if in_flight is not None:  # collect the previous batch while this one computes
                results.extend(self._outputs(*in_flight, global_batch))
            in_flight = (out, n_real)
        if in_flight is not None:
            results.extend(self._outputs(*in_flight, global_batch))
        return results

    def _outputs(self, out, n_real, global_batch):
        host = jax.tree_util.tree_map(lambda x: x[:n_real], to_host(out))
        if self.output_fn is not None:
            outputs = list(self.output_fn(host))
            if len(outputs) != n_real:
                raise DataError(f"output_fn returned {len(outputs)} outputs for a batch of {n_real} "
                                "examples. Fix: return one output per row of its input.")
            return outputs
        return [jax.tree_util.tree_map(lambda x: x[i], host) for i in range(n_real)]


def _check_outputs(out, global_batch):
    """``pred_fn``'s output is arrays with the batch first, and no Python list or tuple of
    per-example rows (split as a pytree, each output would get one column of every row)."""
    def rows_in(node, path):
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            shapes = {(np.shape(x), str(getattr(x, "dtype", ""))) for x in node}
            # rows whose length is the batch pass the shape check below, transposed; (x,)
            # for a batch of 1 is left alone (a one-field tuple, and a row loses nothing)
            if (len(node) == global_batch > 1 and len(shapes) == 1
                    and all(hasattr(x, "shape") and np.ndim(x) and np.shape(x)[0] == global_batch
                            for x in node)):
                raise DataError(
                    f"pred_fn returned a Python {type(node).__name__} of {len(node)} arrays of "
                    f"shape {np.shape(node[0])} at {jax.tree_util.keystr(path) or 'its output'} "
                    f"for a batch of {global_batch} examples: per-example rows, which a pytree "
                    "splits the wrong way (each output would get one column of every row). Fix: "
                    "return one array with the batch first, e.g. jnp.stack(rows); if these are "
                    "fields, not rows, return them in a dict ({'a': ..., 'b': ...}).")
            for i, child in enumerate(node):
                rows_in(child, path + (jax.tree_util.SequenceKey(i),))
        elif isinstance(node, dict):
            for key, child in node.items():
                rows_in(child, path + (jax.tree_util.DictKey(key),))
    rows_in(out, ())
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] != global_batch:
            raise DataError(
                f"pred_fn returned {'a scalar' if np.ndim(leaf) == 0 else f'shape {np.shape(leaf)}'}"
                f" at {jax.tree_util.keystr(path) or 'its output'} for a batch of {global_batch}"
                " examples. Fix: return arrays with the batch dimension first, one row per example"
                " (jnp.stack a list of rows).")


def _laid_out_on(params):
    """The ('dp', 'mp') mesh every leaf of ``params`` is laid out on (a leaf may be on a mesh of
    grouped axes over the same devices), or None."""
    leaves = jax.tree_util.tree_leaves(params)
    if not leaves or not all(isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
                             for x in leaves):
        return None
    meshes = {x.sharding.mesh for x in leaves}
    base = [m for m in meshes if tuple(m.axis_names) == MESH_AXES]
    if len(base) != 1:
        return None
    devices = set(base[0].devices.flat)
    return base[0] if all(set(m.devices.flat) == devices for m in meshes) else None


def _without_dp(spec):
    """``spec`` with the 'dp' axis taken out: where the step uses a parameter FSDP stores split."""
    def drop(entry):
        if entry == DATA_AXIS:
            return None
        if isinstance(entry, tuple):
            rest = tuple(a for a in entry if a != DATA_AXIS)
            return rest[0] if len(rest) == 1 else (rest or None)
        return entry
    return P(*(drop(e) for e in spec))
