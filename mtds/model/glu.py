"""The experts' gated activation: SwiGLU, silu(gate) · up, or GPT-OSS's clamped quick-GeGLU,
(clamp(up, -c, c) + offset) · g · sigmoid(1.702 · g) with g = min(gate, c) (Megatron-core's quick_gelu GLU with
``glu_linear_offset`` and ``activation_func_clamp_value``; transformers' GptOssExperts step for step)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mtds.model.config import ModelConfig

QUICK_GELU_ALPHA = 1.702


def gated_activation(cfg: ModelConfig):
    """(gate, up) -> the activation's output, for cfg's experts."""
    clamp, offset = cfg.activation_func_clamp_value, cfg.glu_linear_offset
    quick = cfg.activation == "quick_geglu"

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if clamp is not None:
            gate, up = gate.clamp(max=clamp), up.clamp(min=-clamp, max=clamp)
        act = gate * torch.sigmoid(gate * QUICK_GELU_ALPHA) if quick else F.silu(gate)
        return (up + offset) * act if offset else act * up
    return glu
