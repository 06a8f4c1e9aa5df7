"""Training: TrainConfig -> run() on a DeepSpeed engine (pipeline engine when p > 1)."""
from .config import TrainConfig
from .loop import RunResult, run

__all__ = ["TrainConfig", "run", "RunResult"]
