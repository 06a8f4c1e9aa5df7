"""The experts of one MoE block, each a SwiGLU MLP tensor-parallel like the dense one (Megatron's
expert-tensor-parallel size = t): gate|up column-parallel, down row-parallel, its partial sums
all-reduced over the TP group. Stored as transformers' 3-D tensors, ``gate_up`` [E, 2F, h] (each
expert's [gate | up] split separately over TP, dim 1) and ``down`` [E, h, F] (split on dim 2), so a
grouped GEMM and expert parallelism (a slice of dim 0) can come later without another layout.

The local experts run as a loop, one pair of GEMMs per expert that got rows (no grouped GEMM yet).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtds.model.config import ModelConfig
from mtds.tp import reduce_from_tensor_parallel_region
from mtds.tp.layers import sharded_parameter

from mtds.model.init import normal_init, output_init


class TensorParallelExperts(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp_group=None):
        super().__init__()
        E, ffn, h = cfg.num_experts, cfg.moe_ffn_size, cfg.hidden_size
        self.group = tp_group
        self.gate_up = sharded_parameter((E, 2 * ffn, h), 1, tp_group, normal_init(cfg.init_std), (ffn, ffn),
                                          None, None)
        self.down = sharded_parameter((E, h, ffn), 2, tp_group, output_init(cfg), None, None, None)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` [sum(counts), h] grouped by expert (``counts[e]`` rows for expert e), replicated over
        TP and entered into the region by the caller; the full outputs, same order."""
        outputs = []
        for e, x in enumerate(rows.split(counts)):
            if not counts[e]:
                continue
            gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e])
            # Reduced per expert, before the routing weight multiplies it: the weight's gradient (and so the
            # router's) then sees the whole output on every rank, not this rank's partial sum.
            outputs.append(reduce_from_tensor_parallel_region(y, self.group))
        return torch.cat(outputs) if outputs else rows.new_zeros(0, rows.shape[-1])
