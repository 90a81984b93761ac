"""A Trainer's first state: the parameters placed by a plan from their shapes alone, the
optimizer state, counters and random keys; and the same state made concrete from parameters."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ..errors import ConfigError
from ..layout.abstract import is_abstract, placed, shapes_of
from ..layout.layout import Candidate, Recipe, frozen_shardings, placed_on, shape_plan
from ..multihost import placement
from ..train_state import TrainState


@dataclasses.dataclass(frozen=True)
class InitialState:
    """``state`` placed by ``plan``; ``keys`` (train, eval) placed as the state is;
    ``abstract``: built from jax.ShapeDtypeStructs (then ``host_keys`` are the keys to place
    when parameters are given)."""

    state: TrainState
    plan: Any
    keys: tuple
    abstract: bool
    host_keys: tuple


def initial_state(recipe: Recipe, deployer, params, optimizer, apply_fn, frozen_params,
                  first: Candidate) -> InitialState:
    """Place ``params`` (copied: the step donates its state, which must never delete the
    caller's arrays), initialise the optimizer and draw the run's two keys from the deployer."""
    mesh = deployer.mesh
    plan = shape_plan(recipe, first, mesh, params)
    param_shardings = plan.param_shardings()
    abstract = is_abstract(params)  # plan and compile, nothing allocated (abstract.py)
    if abstract:
        params = placed(params, param_shardings)
    else:  # device_put may reuse the caller's buffers: a compiled copy owns fresh ones
        params = jax.jit(copy_tree, out_shardings=param_shardings)(
            placement.device_put(params, param_shardings))
    opt_shardings = plan.opt_state_shardings(jax.eval_shape(optimizer.init, params))
    opt_state = (shapes_of(optimizer.init, params, opt_shardings) if abstract else
                 jax.jit(optimizer.init, out_shardings=opt_shardings)(params))
    if frozen_params is not None and (abstract or is_abstract(frozen_params)):
        frozen_params = placed(frozen_params, frozen_shardings(frozen_params, mesh))
    elif frozen_params is not None:  # a copy the step may donate, as for params
        shardings = frozen_shardings(frozen_params, mesh)
        if deployer.n_model_shards > 1 and not placed_on(frozen_params, mesh):
            deployer.log_warning(
                "frozen_params are placed by a plan from their shapes alone. For the plan "
                "traced from the model's data flow, pass them placed: from_pretrained(..., "
                "deployer) does it, or jax.device_put(tree, deployer.get_sharding_plan(tree, "
                "traced_fn=apply_fn, example_args=...).param_shardings()).")
        frozen_params = jax.jit(copy_tree, out_shardings=shardings)(
            placement.device_put(frozen_params, shardings))
    replicated = NamedSharding(mesh, P())
    host_keys = deployer.gen_rng(), deployer.gen_rng()  # drawn alike either way: same streams

    def scalar(value: int) -> Any:  # counters and keys as shapes where the devices may be compile-only
        if abstract:
            return jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        return jax.device_put(jnp.asarray(value, jnp.int32), replicated)

    keys = (placed(host_keys, (replicated, replicated)) if abstract else
            jax.device_put(host_keys, replicated))
    state = TrainState(step=scalar(0), params=params, opt_state=opt_state,
                       nonfinite_step=scalar(-1), apply_fn=apply_fn, tx=optimizer,
                       frozen_params=frozen_params)
    return InitialState(state, plan, keys, abstract, host_keys)


def with_params(layout, state: TrainState, params, reset_opt_state: bool, abstract: bool,
                platform: str) -> TrainState:
    """``state`` continuing from ``params`` (the structure and shapes of its parameters, on any
    mesh; copied, never donated), its optimizer state fresh unless ``reset_opt_state=False``;
    from an abstract state, a concrete one with fresh counters."""
    current = jax.tree_util.tree_map(lambda x: (x.shape, jnp.dtype(x.dtype)), state.params)
    given = jax.tree_util.tree_map(lambda x: (np.shape(x), jnp.dtype(x.dtype)), params)
    if given != current:
        raise ConfigError("set_params was given parameters of another structure, shape or "
                          "dtype than trainer.params. Fix: pass a tree shaped like "
                          "trainer.params (build a new Trainer for another model).")
    if abstract:
        _check_can_be_concrete(layout, state, platform)
    shardings = layout.state_shardings
    params = layout.stored.params_to_storage(jax.jit(copy_tree, out_shardings=shardings.params)(
        placement.device_put(params, shardings.params)))
    state = state.replace(params=params)
    if reset_opt_state or abstract:  # an abstract optimizer state has nothing to keep
        state = state.replace(opt_state=jax.jit(
            state.tx.init, out_shardings=shardings.opt_state)(params))
    if abstract:  # the counters a Trainer built from these params starts with
        state = state.replace(step=jax.device_put(jnp.int32(0), layout.replicated),
                              nonfinite_step=jax.device_put(jnp.int32(-1), layout.replicated))
    return state


def with_opt_state(layout, state: TrainState, opt_state) -> TrainState:
    """``state`` with ``opt_state`` (of its optimizer; copied, never donated) placed as the
    layout places it."""
    try:
        placed_state = placement.device_put(opt_state, layout.state_shardings.opt_state)
    except ValueError as e:
        raise ConfigError(f"opt_state does not match the optimizer's state for these parameters "
                          f"({e}). Fix: pass the state of this optimizer, or opt_state=None to "
                          "initialise it.") from e
    return state.replace(opt_state=copy_tree(placed_state))


def _check_can_be_concrete(layout, state, platform):
    here = set(jax.devices())
    if not all(d in here for d in layout.mesh.devices.flat):
        raise ConfigError(
            f"set_params cannot make this Trainer concrete: its devices ({platform}, e.g. "
            f"{layout.mesh.devices.flat[0]}) are a compile-only target, not devices of this "
            "machine. Fix: plan and compile here; build the Trainer for training on the machine "
            "that has those devices.")
    if state.frozen_params is not None and is_abstract(state.frozen_params):
        raise ConfigError("set_params cannot make this Trainer concrete: its frozen_params "
                          "are abstract (jax.ShapeDtypeStruct) too. Fix: build the Trainer "
                          "with the real frozen_params.")


def copy_tree(tree):
    return jax.tree_util.tree_map(jnp.copy, tree)
