"""redcoast: distributed training and inference of large models on JAX from three functions."""

from .deployer import Deployer
from .errors import CheckpointError, ConfigError, DataError, LossError, NonFiniteLossError, RedcoastError
from .predictor import Predictor
from .sharding import ShardingPlan
from .train_state import TrainState
from .trainer import Trainer

__version__ = "0.1.0"

__all__ = ["Deployer", "Trainer", "Predictor", "TrainState", "ShardingPlan", "RedcoastError",
           "CheckpointError", "ConfigError", "DataError", "LossError", "NonFiniteLossError"]
