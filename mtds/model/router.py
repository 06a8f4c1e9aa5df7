"""The MoE router: transformers' top-k routing (Mixtral, Qwen3-MoE), dropless unless a capacity is asked for.

softmax over all experts in float32, the k largest probabilities, renormalised to sum 1 when
``norm_topk_prob`` (Mixtral always; Qwen3-MoE per its config). The weight is replicated on every
tensor-parallel rank: each rank routes the same tokens identically, so its gradient is the same everywhere,
like a norm's; with sequence parallelism each rank routes its own slice and the gradients are summed. The
logits are computed in float32 (Megatron's router dtype): under bf16 / fp16 a rounded logit can flip a near
tie; at fp32 this is transformers' arithmetic exactly.

DeepSeek-V3's router (``moe_router_score_function`` sigmoid): per-expert sigmoid scores; with the expert bias
(``e_score_correction_bias``, an fp32 buffer [E], moved only by the aux-loss-free update of
:mod:`mtds.training.expert_bias`) added to the scores for the choice only; with groups, the experts split into
``moe_router_num_groups`` groups, each scored by the sum of its two best (biased) scores, and only the
``moe_router_group_topk`` best groups take part; the k weights are the unbiased scores of the chosen experts,
renormalised with ``norm_topk_prob`` (+1e-20, as transformers) and multiplied by
``moe_router_topk_scaling_factor``. transformers' ``DeepseekV3TopkRouter`` step for step.

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
        self.sigmoid = cfg.moe_router_score_function == "sigmoid"
        self.groups, self.group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
        self.scaling = cfg.moe_router_topk_scaling_factor
        # GPT-OSS's router bias (linear_bias): added to the logits, so to the choice and the weights; zero at init
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.linear_bias else None
        if cfg.moe_router_enable_expert_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse=True):
        """The expert bias stays float32 when the model is cast (model.bfloat16(), DeepSpeed's half()):
        sign updates of 1e-3 would vanish in a bf16 bias; only its device follows."""
        bias = self.e_score_correction_bias
        out = super()._apply(fn, recurse)
        if bias is not None:
            moved = self._buffers["e_score_correction_bias"]
            self._buffers["e_score_correction_bias"] = moved if moved.dtype == torch.float32 else \
                bias.to(device=moved.device)
        return out

    def forward(self, tokens: torch.Tensor, weight: torch.Tensor | None = None, batch: int = 1,
                bias: torch.Tensor | None = None) -> Routing:
        """``tokens``: [N, h] (``batch`` sequences); ``weight`` (and ``bias``): the router's as the caller wants
        them used (sequence parallelism passes them through the identity that sums their gradient over TP)."""
        weight = self.weight if weight is None else weight
        bias = self.bias if bias is None else bias
        logits = F.linear(tokens.float(), weight.float(), None if bias is None else bias.float())
        if self.sigmoid:
            probs = torch.sigmoid(logits)
            weights, experts = self._sigmoid_choice(probs)
        else:
            probs = torch.softmax(logits, dim=-1)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
            if self.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scaling is not None:
            weights = weights * self.scaling
        z_sum = torch.logsumexp(logits, dim=-1).square().sum() if self.z_loss and self.training else None
        kept = None if self.capacity_factor is None else kept_assignments(
            weights, experts, probs.shape[-1], self.capacity_factor, self.drop_policy, batch)
        return Routing(probs, weights, experts, z_sum, kept)

    def _sigmoid_choice(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        choice = scores.detach()
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias
        if self.groups is not None:
            n, E = choice.shape
            grouped = choice.view(n, self.groups, E // self.groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            best = torch.topk(group_scores, self.group_topk, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, E)
        experts = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, experts
