"""Learning-rate schedule: linear warm-up, then cosine / linear decay to ``min_lr`` (or constant)."""
from __future__ import annotations

import math

import torch


def lr_factor(step: int, *, base_lr: float, min_lr: float, warmup: int, total: int, decay: str) -> float:
    """Multiplier on ``base_lr`` for optimizer step ``step`` (0-based, the step about to run)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = min_lr / base_lr if base_lr else 0.0
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return floor + (1.0 - floor) * shape


def build_scheduler(optimizer, *, base_lr: float, min_lr: float, warmup: int, total: int, decay: str):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, base_lr=base_lr, min_lr=min_lr, warmup=warmup, total=total,
                                          decay=decay))
