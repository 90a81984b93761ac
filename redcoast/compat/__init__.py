"""redco 0.4.23 compatibility, kept apart from the core.

``redcoast.Deployer``, ``redcoast.Trainer`` and ``redcoast.Predictor`` are the classes here: the
core classes (``redcoast.deployer``, ``redcoast.trainer``, ``redcoast.predictor``) plus redco's
method names, keywords and calling conventions, so a redco script runs with its import changed.
Where redcoast deliberately differs (gradient accumulation, checkpoints, mixed precision) the
redco form is accepted, does the right thing and warns once (:class:`RedcoCompatWarning`) with
the redcoast way; a form that cannot be honoured fails at once naming the replacement.
"""

from .calls import by_keyword
from .deployer import Deployer
from .notices import RedcoCompatWarning
from .predictor import Predictor
from .rules import AutoShardingRules
from .trainer import Trainer

__all__ = ["Deployer", "Trainer", "Predictor", "RedcoCompatWarning", "AutoShardingRules",
           "by_keyword"]
