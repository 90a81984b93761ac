"""redco 0.4.23's Predictor keywords and calling conventions on top of redcoast's Predictor."""

from .. import predictor as core
from .calls import COLLATE_FN_ARGS, PRED_FN_ARGS, by_keyword


class Predictor(core.Predictor):
    __doc__ = core.Predictor.__doc__ + """
    ``pred_fn`` and ``collate_fn`` are called by keyword where they name redco's arguments
    (``rng``, ``params``, ``batch``; ``examples``), as redco called them.
    """

    def __init__(self, deployer, collate_fn, pred_fn, output_fn=None, params_sharding_rules=None):
        super().__init__(deployer, by_keyword(collate_fn, COLLATE_FN_ARGS),
                         by_keyword(pred_fn, PRED_FN_ARGS, copy_batch=True), output_fn=output_fn,
                         params_sharding_rules=params_sharding_rules)

    def predict(self, examples, per_device_batch_size, params, params_replicated=False,
                params_sharded=False, desc=None, rng=None):
        """As redcoast's; redco's ``params_replicated``/``params_sharded`` change nothing
        (redcoast places the parameters itself)."""
        del params_replicated, params_sharded
        return super().predict(examples, per_device_batch_size, params, desc=desc, rng=rng)

    @property
    def mesh(self):
        return self.deployer.mesh
