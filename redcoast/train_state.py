"""The training state: step, parameters, optimizer state, and the functions that use them."""

import dataclasses
from typing import Any, Callable

import jax
import optax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """What one training step reads and writes (as in redco and Flax's ``TrainState``).

    ``apply_fn`` and ``tx`` are static: they are part of the compiled step, not data.
    ``frozen_params``: parameters the step reads but never trains (e.g. a LoRA base), an input
    of the step like ``params`` but without gradient or optimizer state; None when there are none.
    """
    step: jax.Array
    params: Any
    opt_state: Any
    nonfinite_step: jax.Array  # -1, or the first step whose loss was NaN or inf
    apply_fn: Callable = dataclasses.field(metadata=dict(static=True))
    tx: Any = dataclasses.field(metadata=dict(static=True))
    frozen_params: Any = None

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def apply_gradients(self, grads, **changes):
        """One optimizer update from ``grads`` (Flax's and redco's ``TrainState`` method)."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(step=self.step + 1, params=optax.apply_updates(self.params, updates),
                            opt_state=opt_state, **changes)
