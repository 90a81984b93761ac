"""redcoast: distributed training and inference of large models on JAX from three functions."""

from .callbacks import Callback, EarlyStopping, History
from .compat import Deployer, Predictor, RedcoCompatWarning, Trainer  # core classes + redco's forms
from .errors import (CheckpointError, ConfigError, DataError, EvaluationError, LayoutCheckError,
                     LossError, NonFiniteLossError, RedcoastError)
from .lora import LoRA, load_adapters, save_adapters
from .sharding import ShardingPlan
from .train_state import TrainState

__version__ = "0.1.0"

__all__ = ["Deployer", "Trainer", "Predictor", "TrainState", "ShardingPlan", "RedcoastError",
           "CheckpointError", "ConfigError", "DataError", "EvaluationError", "LayoutCheckError",
           "LossError", "NonFiniteLossError", "RedcoCompatWarning", "LoRA", "save_adapters",
           "load_adapters", "Callback", "EarlyStopping", "History"]
