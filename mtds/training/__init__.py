"""Training: TrainConfig -> run() on a DeepSpeed engine (pipeline engine when p > 1)."""
from mtds.training.config import TrainConfig
from mtds.training.job import RunResult, run

__all__ = ["TrainConfig", "run", "RunResult"]
