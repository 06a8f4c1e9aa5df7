"""The MoE router: transformers' top-k routing (Mixtral, Qwen3-MoE), dropless unless a capacity is asked for.

softmax over all experts in float32, the k largest probabilities, renormalised to sum 1 when
``norm_topk_prob`` (Mixtral always; Qwen3-MoE per its config). The weight is replicated on every
tensor-parallel rank: each rank routes the same tokens identically, so its gradient is the same everywhere,
like a norm's; with sequence parallelism each rank routes its own slice and the gradients are summed. The
logits are computed in float32 (Megatron's router dtype): under bf16 / fp16 a rounded logit can flip a near
tie; at fp32 this is transformers' arithmetic exactly.

Two of Megatron-core's options, both off by default (then nothing here changes): the router z-loss (ST-MoE;
``z_sum``, the sum over this call's tokens of logsumexp(logits)², from the float32 logits before the
softmax, training only, as ``z_loss_func``) and the expert capacity (:mod:`mtds.model.capacity`: ``kept``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtds.model.capacity import kept_assignments
from mtds.model.config import ModelConfig
from mtds.model.init import normal_init


@dataclass
class Routing:
    """One block's decision for its N tokens: ``probs`` [N, E] fp32 (the aux loss reads them), ``weights``
    [N, k] (the combine's multipliers, fp32) and ``experts`` [N, k] (int64, each row in descending probability)."""
    probs: torch.Tensor
    weights: torch.Tensor
    experts: torch.Tensor
    z_sum: torch.Tensor | None = None   # sum over the tokens of logsumexp(logits)² (z-loss on, training)
    kept: torch.Tensor | None = None    # [N, k] bool: False where the capacity drops it; None: none dropped

    def dispatched(self, num_experts: int) -> "Routing":
        """The routing the dispatch sees: a dropped assignment's expert is ``num_experts``, which sorts last
        and is sent nowhere (its weight is never read)."""
        if self.kept is None:
            return self
        return Routing(self.probs, self.weights, self.experts.masked_fill(~self.kept, num_experts))


class TopKRouter(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.normalize = cfg.moe_top_k, cfg.norm_topk_prob
        self.z_loss = cfg.moe_z_loss_coeff > 0
        self.capacity_factor, self.drop_policy = cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        normal_init(cfg.init_std)(self.weight.data)

    def forward(self, tokens: torch.Tensor, weight: torch.Tensor | None = None, batch: int = 1) -> Routing:
        """``tokens``: [N, h] (``batch`` sequences); ``weight``: the router weight as the caller wants it used
        (sequence parallelism passes it through the identity that sums its gradient over the TP ranks)."""
        weight = self.weight if weight is None else weight
        logits = F.linear(tokens.float(), weight.float())
        probs = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        z_sum = torch.logsumexp(logits, dim=-1).square().sum() if self.z_loss and self.training else None
        kept = None if self.capacity_factor is None else kept_assignments(
            weights, experts, probs.shape[-1], self.capacity_factor, self.drop_policy, batch)
        return Routing(probs, weights, experts, z_sum, kept)
