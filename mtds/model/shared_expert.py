"""The shared expert of an MoE block (Qwen2-MoE, DeepSeek-V3; Megatron-core's ``moe_shared_expert_*``): a dense
SwiGLU MLP of ``moe_shared_expert_intermediate_size`` that every token goes through beside its routed experts,
tensor-parallel like the dense MLP (gate|up column-parallel, down row-parallel; with sequence parallelism it
gathers and reduce-scatters the slices itself). Its weights are replicated over the expert-parallel ranks
(an ordinary dense parameter: reduced over the whole data-parallel group).

With ``moe_shared_expert_gate`` (Qwen2-MoE) its output is scaled per token by sigmoid(x · w), w [1, h]
replicated on every TP rank like the router's weight: each rank computes the same scale from the same tokens;
under sequence parallelism from its own slice, the weight's gradient then summed over TP like a norm's.

It runs before the dispatch, on the block input, so on an accelerator its GEMMs could overlap the all-to-all;
mtds issues the collectives synchronously, so it does not overlap today.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtds.model.config import ModelConfig
from mtds.model.init import normal_init
from mtds.model.mlp import MLP
from mtds.tp import mark_sequence_parallel, shared_by_sequence_shards


class SharedExpert(MLP):
    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False):
        super().__init__(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel,
                         ffn_size=cfg.moe_shared_expert_intermediate_size)
        self.group, self.sequence_parallel = tp_group, sequence_parallel
        self.gate = None
        if cfg.moe_shared_expert_gate:
            self.gate = nn.Parameter(torch.empty(1, cfg.hidden_size))
            normal_init(cfg.init_std)(self.gate.data)
            if sequence_parallel:
                mark_sequence_parallel(self.gate)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden)
        if self.gate is None:
            return out
        gate = shared_by_sequence_shards(self.gate, self.group) if self.sequence_parallel else self.gate
        return torch.sigmoid(F.linear(hidden, gate)) * out
