"""LayerNorm / RMSNorm chosen by cfg.normalization (norm weights start at one, biases at zero)."""
from __future__ import annotations

import torch
from torch import nn

from mtds.config import ModelConfig


class RMSNorm(nn.Module):
    """w * x / rms(x): normalised in float32 and cast back before the weight, in HF Llama's order,
    so imported Llama models reproduce HF numerics in half precision too."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.normalization == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
