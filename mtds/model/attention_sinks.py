"""Attention with sinks (GPT-OSS; Megatron-core's ``softmax_type="learnable"``): each head h has a learned logit
s_h that joins every query's softmax denominator and attends to nothing,

    p_ij = exp(z_ij) / (exp(s_h) + sum_j' exp(z_ij')),

so a query may put less than all of its weight on the keys. Computed eagerly (SDPA takes no extra logit): scores,
the causal / window / document mask, the sink column appended, softmax, the sink column dropped, then x V.
Under tensor parallelism the sinks split with the heads (rank r holds its query heads' logits)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor | None, dropout_p: float = 0.0) -> torch.Tensor:
    """q [b, H, s, d], k / v [b, KV, s, d] (query head i reads kv head i // (H / KV)), ``sinks`` [H];
    ``mask``: bool, True = may attend (causal already), broadcasting to [b, H, s, s]; None: causal."""
    b, heads, s, d = q.shape
    if k.shape[1] != heads:
        k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * d ** -0.5
    if mask is None:
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, heads, 1, 1).expand(b, heads, s, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs.to(v.dtype), v)
