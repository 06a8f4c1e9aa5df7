"""One transformer block (pre-norm), optionally with NeoX's parallel residual."""
from __future__ import annotations

import torch
from torch import nn

from mtds.config import ModelConfig

from .attention import SelfAttention
from .init import seeded
from .mlp import MLP
from .norms import make_norm


class TransformerLayer(nn.Module):
    """layer_number is the *global* layer index (1..L): it seeds the init, so a layer's weights
    are the same whichever pipeline stage builds it."""

    def __init__(self, cfg: ModelConfig, layer_number: int, *, tp_group=None, seed: int = 1234, rng_tracker=None):
        super().__init__()
        if not 1 <= layer_number <= cfg.num_layers:
            raise ValueError(f"layer_number {layer_number} outside 1..{cfg.num_layers} (global index)")
        self.layer_number = layer_number
        self.parallel_residual = cfg.parallel_residual
        with seeded(seed, layer_number):
            self.input_norm = make_norm(cfg)
            self.attention = SelfAttention(cfg, tp_group=tp_group, rng_tracker=rng_tracker)
            self.post_attention_norm = make_norm(cfg)
            self.mlp = MLP(cfg, tp_group=tp_group)
        # Residual-stream dropout acts on replicated activations (after the row-parallel all-reduce):
        # the default generator, seeded alike on all TP ranks, drops the same elements everywhere.
        self.attention_dropout = nn.Dropout(cfg.hidden_dropout)
        self.mlp_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        attn = self.attention_dropout(self.attention(self.input_norm(hidden)))
        if self.parallel_residual:   # NeoX: both branches read the block input
            return hidden + attn + self.mlp_dropout(self.mlp(self.post_attention_norm(hidden)))
        hidden = hidden + attn
        return hidden + self.mlp_dropout(self.mlp(self.post_attention_norm(hidden)))
