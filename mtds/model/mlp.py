"""Feed-forward block: column-parallel up projection, elementwise activation on the local shard,
row-parallel down projection. SwiGLU fuses gate|up into one column-parallel matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtds.model.config import ModelConfig
from mtds.tp import ColumnParallelLinear, RowParallelLinear

from mtds.model.init import normal_init, output_init


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 ffn_size: int | None = None):
        """``ffn_size``: the width, if not cfg's (an MoE block's shared expert)."""
        super().__init__()
        self.activation = cfg.activation
        ffn = ffn_size or cfg.ffn_size
        gated = cfg.activation == "swiglu"
        # Segments [gate, up] give every rank matching columns of both, so silu(gate) * up stays local.
        self.fc_in = ColumnParallelLinear(cfg.hidden_size, 2 * ffn if gated else ffn, group=tp_group,
                                          bias=cfg.linear_bias, init_method=normal_init(cfg.init_std),
                                          output_segments=[ffn, ffn] if gated else None,
                                          sequence_parallel=sequence_parallel)
        self.fc_out = RowParallelLinear(ffn, cfg.hidden_size, group=tp_group, bias=cfg.linear_bias,
                                        input_is_parallel=True, init_method=output_init(cfg),
                                        sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc_in(x)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.activation == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        else:
            h = F.gelu(h)
        return self.fc_out(h)
