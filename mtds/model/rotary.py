"""Rotary position embeddings (RoFormer), HF NeoX/Llama "rotate_half" convention.

The first rotary_dim dims of each head are split into two halves (x1, x2) rotated as pairs
(x1_i, x2_i) by angle pos * base^(-2i/rotary_dim); the remaining dims pass through (partial rotary).
"""
from __future__ import annotations

import torch

from mtds.model.config import ModelConfig


def rotary_cos_sin(cfg: ModelConfig, seq_len: int, device, dtype,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [seq, rotary_dim], or [b, 1, seq, rotary_dim] for per-sample ``positions``
    [b, seq] (packed documents). In float32 (each attention layer keeps the plain ones per (seq, device, dtype)),
    so no frequency buffer can be rounded by a later model.half()/bfloat16()."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if positions is None:
        positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    else:
        positions = positions.to(torch.float32)[:, None]           # [b, 1 (heads), s]
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, s, head_dim]; cos/sin: [s, rotary_dim] or [b, 1, s, rotary_dim]."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    rot = rot * cos + _rotate_half(rot) * sin
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot
