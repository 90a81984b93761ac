"""Batched, ordered prediction with sharded parameters: one output per example, in input order."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .data import BatchMaker, padded_batches, prefetch
from .errors import DataError
from .host import to_host
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
        self._rng = deployer.gen_rng()
        self._compiled = {}
        self._plan_owner = None

    def follow_plan_of(self, trainer):
        """Place parameters as ``trainer`` does, now and after it refines its plan."""
        self._plan_owner = trainer

    def _step_for(self, params):
        """The sharded params and the jitted step for this params structure (built once)."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        key = (treedef, tuple((np.shape(x), str(getattr(x, "dtype", ""))) for x in leaves))
        owner_plan = self._plan_owner.plan if self._plan_owner is not None else None
        key = key + (id(owner_plan),)
        if key not in self._compiled:
            plan = owner_plan or self.deployer.get_sharding_plan(params, self.params_sharding_rules)
            shardings, used = plan.param_shardings(), plan.compute_shardings()
            mesh = self.deployer.mesh
            pred_fn = laid_out_for(self.pred_fn, self.deployer.n_model_shards)

            def step(p, batch, rng, index):
                # parameters stored split further (FSDP) are gathered where used, not the activations
                p = jax.lax.with_sharding_constraint(p, used)
                return pred_fn(jax.random.fold_in(rng, index), p, batch)

            jitted = jax.jit(step, in_shardings=(shardings, NamedSharding(mesh, P("dp")),
                                                 NamedSharding(mesh, P()), NamedSharding(mesh, P())))
            self._compiled[key] = (shardings, jitted)
        return self._compiled[key]

    def predict(self, examples, per_device_batch_size, params, desc=None):
        """A list with exactly one output per example, in the order of ``examples``."""
        shardings, step = self._step_for(params)
        params = jax.device_put(params, shardings)
        global_batch = self.deployer.global_batch_size(per_device_batch_size)
        maker = BatchMaker(self.deployer.mesh, self.collate_fn, global_batch)
        batches = prefetch((maker.make(examples, idx), n_real)
                           for idx, n_real in padded_batches(len(examples), global_batch))
        results, in_flight = [], None
        for index, (batch, n_real) in enumerate(batches):
            out = step(params, batch, self._rng, jnp.int32(index))
            if in_flight is not None:  # collect the previous batch while this one computes
                results.extend(self._outputs(*in_flight, global_batch))
            in_flight = (out, n_real)
        if in_flight is not None:
            results.extend(self._outputs(*in_flight, global_batch))
        return results

    def _outputs(self, out, n_real, global_batch):
        host = to_host(out)
        for path, leaf in jax.tree_util.tree_flatten_with_path(host)[0]:
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] != global_batch:
                raise DataError(
                    f"pred_fn returned {'a scalar' if np.ndim(leaf) == 0 else f'shape {np.shape(leaf)}'}"
                    f" at {jax.tree_util.keystr(path) or 'its output'} for a batch of {global_batch}"
                    " examples. Fix: return arrays with the batch dimension first, one row per example.")
        host = jax.tree_util.tree_map(lambda x: x[:n_real], host)
        if self.output_fn is not None:
            outputs = list(self.output_fn(host))
            if len(outputs) != n_real:
                raise DataError(f"output_fn returned {len(outputs)} outputs for a batch of {n_real} "
                                "examples. Fix: return one output per row of its input.")
            return outputs
        return [jax.tree_util.tree_map(lambda x: x[i], host) for i in range(n_real)]
