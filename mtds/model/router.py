"""The MoE router: transformers' top-k routing (Mixtral, Qwen3-MoE), dropless.

softmax over all experts in float32, the k largest probabilities, renormalised to sum 1 when
``norm_topk_prob`` (Mixtral always; Qwen3-MoE per its config). The weight is replicated on every
tensor-parallel rank: each rank routes the same tokens identically, so its gradient is the same everywhere,
like a norm's; with sequence parallelism each rank routes its own slice and the gradients are summed. The
logits are computed in float32 (Megatron's router dtype): under bf16 / fp16 a rounded logit can flip a near
tie; at fp32 this is transformers' arithmetic exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtds.model.config import ModelConfig
from mtds.model.init import normal_init


@dataclass
class Routing:
    """One block's decision for its N tokens: ``probs`` [N, E] fp32 (the aux loss reads them), ``weights``
    [N, k] (the combine's multipliers, fp32) and ``experts`` [N, k] (int64, each row in descending probability)."""
    probs: torch.Tensor
    weights: torch.Tensor
    experts: torch.Tensor


class TopKRouter(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.normalize = cfg.moe_top_k, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        normal_init(cfg.init_std)(self.weight.data)

    def forward(self, tokens: torch.Tensor, weight: torch.Tensor | None = None) -> Routing:
        """``tokens``: [N, h]; ``weight``: the router weight as the caller wants it used (sequence
        parallelism passes it through the identity that sums its gradient over the TP ranks)."""
        weight = self.weight if weight is None else weight
        logits = F.linear(tokens.float(), weight.float())
        probs = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(probs, weights, experts)
