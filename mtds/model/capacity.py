"""Megatron-core's expert capacity (``--moe-expert-capacity-factor F``, ``--moe-token-drop-policy``), an
optional departure from transformers' dropless routing (docs/moe.md).

As ``megatron/core/transformer/moe/moe_utils.py`` (``get_capacity``, ``apply_router_token_dropping``): over
the N tokens this router call sees (this rank's; with sequence parallelism this rank's slice), each expert
keeps at most ``capacity = ceil((N·k / E) · F)`` of the (token, expert) assignments made to it, no minimum.
``probs`` keeps the ones with the largest routing weight (the k weights after any renormalisation, which
the drop does not redo); ``position`` the earliest in Megatron's token order, which is [s, b] (sequence
position first, then the sequence in the batch; mtds's tokens are [b, s]). A dropped assignment computes
nothing and adds nothing to its token's output (the token keeps its residual). Nothing drops when the
capacity exceeds N (an expert can get at most N). The aux loss's counts are the assignments before dropping.
"""
from __future__ import annotations

import math

import torch

DROP_POLICIES = ("probs", "position")


def expert_capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    # Megatron's float expression, in its order: ceil((num_tokens / num_experts) * capacity_factor),
    # num_tokens = N·k
    return math.ceil((tokens * top_k / num_experts) * factor)


def kept_assignments(weights: torch.Tensor, experts: torch.Tensor, num_experts: int, factor: float,
                     policy: str, batch: int = 1) -> torch.Tensor | None:
    """[N, k] bool, False where the assignment is dropped; None when nothing can drop. ``batch``: the
    sequences the N tokens hold ([b, s/t] flattened), for the position order."""
    n, k = experts.shape
    capacity = expert_capacity(n, k, num_experts, factor)
    if capacity >= n:
        return None
    if policy == "probs":
        dense = torch.zeros(n, num_experts, dtype=weights.dtype, device=weights.device)
        dense.scatter_(1, experts, weights.detach())
        # per expert the `capacity` largest weights (an unrouted token holds 0 and is masked by the routing)
        _, rows = torch.topk(dense, capacity, dim=0, sorted=False)
        keep = torch.zeros(n, num_experts, dtype=torch.bool, device=weights.device).scatter_(0, rows, True)
        return keep.gather(1, experts)
    # position: the first `capacity` assignments of each expert in [s, b] order (token i of [b, s] is
    # sequence i // s, position i % s)
    s = n // batch
    order = torch.arange(n, device=experts.device).view(batch, s).t().reshape(-1)
    routed = torch.zeros(n, num_experts, dtype=torch.int64, device=experts.device).scatter_(1, experts, 1)
    seen = torch.empty_like(routed).index_copy_(0, order, routed[order].cumsum(dim=0))
    return seen.gather(1, experts) <= capacity
