"""redco's optimizers in redcoast: ``optax.MultiSteps`` and label trees built with ``freeze``."""

import jax
import optax
from flax.core import freeze

from ..errors import ConfigError
from ..validate import tree_keys
from .notices import warn_redco


def _contains_multisteps(opt_state_shape):
    leaves = jax.tree_util.tree_leaves(
        opt_state_shape, is_leaf=lambda x: isinstance(x, optax.MultiStepsState))
    return any(isinstance(x, optax.MultiStepsState) for x in leaves)


def unwrap_multisteps(optimizer, opt_state, accumulate_grad_batches, params):
    """``(optimizer, opt_state)`` with redco's ``optax.MultiSteps`` replaced by redcoast's
    accumulation, so that micro-batches are never accumulated twice (k x k)."""
    k = accumulate_grad_batches
    if isinstance(optimizer, optax.MultiSteps):
        every_k = optimizer._every_k_schedule(0)  # noqa: SLF001 - optax keeps k only there
        if k > 1:
            if int(every_k) != k:
                raise ConfigError(
                    f"optax.MultiSteps(every_k_schedule={int(every_k)}) and accumulate_grad_batches="
                    f"{k} disagree. Fix: drop optax.MultiSteps and keep accumulate_grad_batches={k}.")
            warn_redco(
                f"optax.MultiSteps with accumulate_grad_batches={k}: redcoast accumulates the {k} "
                "micro-batches inside its step and applies the inner optimizer once per update "
                "(MultiSteps is unwrapped, not applied on top: that would accumulate k x k). "
                "Fix: pass the inner optimizer and accumulate_grad_batches.")
            if isinstance(opt_state, optax.MultiStepsState):
                opt_state = opt_state.inner_opt_state
            return optimizer.inner_opt, opt_state
        return optimizer, opt_state
    if k > 1 and _contains_multisteps(jax.eval_shape(optimizer.init, params)):
        raise ConfigError(
            f"The optimizer holds an optax.MultiSteps inside it (e.g. in optax.multi_transform) "
            f"and accumulate_grad_batches={k}: the step would accumulate {k} x {k} micro-batches "
            "per update. Fix: remove optax.MultiSteps (redcoast accumulates through "
            "accumulate_grad_batches) or pass accumulate_grad_batches=1.")
    return optimizer, opt_state


def params_for_optimizer(optimizer, params):
    """``params``, frozen when the optimizer's labels were built with ``flax.core.freeze``
    (redco froze the parameters, so ``multi_transform(param_labels=freeze(...))`` matched)."""
    tree_keys("params", params)  # keys JAX cannot sort: named here, not as the optimizer's fault
    try:
        jax.eval_shape(optimizer.init, params)
        return params
    except (ValueError, TypeError) as first_error:
        try:
            frozen = freeze(params)
            jax.eval_shape(optimizer.init, frozen)
        except Exception:  # noqa: BLE001 - freezing does not help: report the original error
            raise ConfigError(
                f"optimizer.init(params) failed: {first_error}. Fix: give the optimizer's label "
                "tree (optax.multi_transform's param_labels) the structure of params.") from first_error
        warn_redco("The optimizer's labels are a flax FrozenDict (freeze(...)), so the parameters "
                   "are frozen to match, as redco did. Fix: build the labels as a plain dict.")
        return frozen
