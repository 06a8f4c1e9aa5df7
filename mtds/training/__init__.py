"""Training: TrainConfig -> run() on a DeepSpeed engine (pipeline engine when p > 1)."""
from mtds.training.config import TrainConfig

__all__ = ["TrainConfig", "run", "RunResult"]


def __getattr__(name: str):
    """``run`` and ``RunResult`` import DeepSpeed: only when asked for, so that train.py parses its flags (and
    mtds.observe.quiet installs its filters) first."""
    if name in ("run", "RunResult"):
        from mtds.training import job
        return getattr(job, name)
    raise AttributeError(f"module 'mtds.training' has no attribute {name!r}")
