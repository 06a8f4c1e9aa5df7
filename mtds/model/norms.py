"""LayerNorm / RMSNorm chosen by cfg.normalization (norm weights start at one, biases at zero).

With sequence parallelism a norm sees only this rank's slice of the sequence, so its (replicated)
weights are marked ``sequence_parallel`` and pass through `shared_by_sequence_shards`: their gradient
is summed over the TP group, per use or once per step (see :mod:`mtds.tp.sequence_grads`).
The parameter names stay those of torch's LayerNorm, so checkpoints and HF mapping are unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtds.model.config import ModelConfig
from mtds.tp import mark_sequence_parallel, shared_by_sequence_shards


class RMSNorm(nn.Module):
    """w * x / rms(x): normalised in float32 and cast back before the weight, in HF Llama's order,
    so imported Llama models reproduce HF numerics in half precision too."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel_group=None):
        super().__init__()
        self.eps = eps
        self.sequence_parallel_group = sequence_parallel_group
        self.weight = nn.Parameter(torch.ones(hidden_size))
        if sequence_parallel_group is not None:
            mark_sequence_parallel(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return shared_by_sequence_shards(self.weight, self.sequence_parallel_group) * x32.to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm, with gradients summed over sequence slices under sequence parallelism."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel_group=None):
        super().__init__(hidden_size, eps=eps)
        self.sequence_parallel_group = sequence_parallel_group
        if sequence_parallel_group is not None:
            mark_sequence_parallel(self.weight)
            mark_sequence_parallel(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.sequence_parallel_group
        return F.layer_norm(x, self.normalized_shape, shared_by_sequence_shards(self.weight, group),
                            shared_by_sequence_shards(self.bias, group), self.eps)


def make_norm(cfg: ModelConfig, sequence_parallel_group=None, size: int | None = None) -> nn.Module:
    """``sequence_parallel_group``: the TP group when activations are split along the sequence (or, for the
    q/k norm, along the heads: any replicated weight whose gradient is a partial sum over the group).
    ``size``: the normalised dim, hidden_size unless given (the q/k norm: head_dim)."""
    size = size or cfg.hidden_size
    if cfg.normalization == "rmsnorm":
        return RMSNorm(size, cfg.norm_eps, sequence_parallel_group)
    return LayerNorm(size, cfg.norm_eps, sequence_parallel_group)
