"""One attention block (local queries × one rank's keys) and the online-softmax merge of blocks.

Shapes: queries are grouped by key/value head for GQA, q5 [b, hkv, g, n, d] with g = hq / hkv
(query head i = kv head i // g, the repeat_kv order), keys/values k5, v5 [b, hkv, 1, m, d]; the
broadcast over g stands in for repeating K/V, and summing over g is the GQA reduction of dK/dV.

Forward of a block, with S = scale·q kᵀ (masked entries −∞) computed in float32:
    lse_blk = log Σ_j exp(S_ij),   O_blk = softmax(S) v
Merging two partial results over disjoint key sets (Milakov & Gimelshein 2018, as in FlashAttention):
    lse = log(exp(lse_a) + exp(lse_b)),   O = exp(lse_a − lse)·O_a + exp(lse_b − lse)·O_b
Backward of a block from the final lse and D = rowsum(dO ∘ O):
    P = exp(S − lse),  dV = Pᵀ dO,  dS = P ∘ (dO vᵀ − D),  dQ = scale·dS k,  dK = scale·dSᵀ q
Matrix products run in the input dtype (bf16 on GPU); the softmax statistics, lse and the
accumulators stay float32.

Rows are independent in all of this but for dK/dV, which sum over them, so a block is computed in tiles of
query rows: the n × m scores of one tile at a time, at most ``SCORE_ELEMENTS`` of them over batch and heads
(64 MiB in fp32), instead of all n × m at once ((s/C)² per head: 2 GiB for 8 heads at s/C = 8192).
"""
from __future__ import annotations

import torch

SCORE_ELEMENTS = 1 << 24


def row_tiles(q5: torch.Tensor, m: int):
    """Slices of the n query rows of ``q5`` [b, hkv, g, n, d] whose scores against m keys fit SCORE_ELEMENTS."""
    b, hkv, g, n, _ = q5.shape
    step = max(1, SCORE_ELEMENTS // max(1, b * hkv * g * m))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _rows(mask: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return mask if mask is None or mask.shape[-2] == 1 else mask[..., rows, :]


def block_scores(q5: torch.Tensor, k5: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """S = scale·q kᵀ in float32, −∞ where ``mask`` (broadcastable to S, True = attend) is False."""
    s = torch.matmul(q5, k5.transpose(-1, -2)).float() * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def block_forward(q5, k5, v5, scale, mask):
    """(O_blk float32 [b, hkv, g, n, d], lse_blk [b, hkv, g, n]); a row with no visible key: lse −∞, O 0."""
    tiles = row_tiles(q5, k5.shape[-2])
    if len(tiles) > 1:
        parts = [_block_forward(q5[..., rows, :], k5, v5, scale, _rows(mask, rows)) for rows in tiles]
        return torch.cat([o for o, _ in parts], dim=-2), torch.cat([lse for _, lse in parts], dim=-1)
    return _block_forward(q5, k5, v5, scale, mask)


def _block_forward(q5, k5, v5, scale, mask):
    s = block_scores(q5, k5, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    # exp(−∞ − (−∞)) would be NaN for a fully masked row: subtract 0 there instead (its P is all 0).
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    return torch.matmul(p.to(v5.dtype), v5).float(), lse


def merge(out: torch.Tensor, lse: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """Fold a block into the running (out, lse) in place; ``lse`` must already be finite (the own
    block always comes first, and every token sees itself)."""
    new = torch.logaddexp(lse, lse_blk)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(out_blk * torch.exp(lse_blk - new).unsqueeze(-1))
    lse.copy_(new)


def block_backward(q5, k5, v5, do5, lse, delta, scale, mask):
    """(dQ [b, hkv, g, n, d], dK, dV [b, hkv, m, d]) of one block, float32, from the final lse and D."""
    tiles = row_tiles(q5, k5.shape[-2])
    if len(tiles) == 1:
        return _block_backward(q5, k5, v5, do5, lse, delta, scale, mask)
    dq, dk, dv = [], 0, 0
    for rows in tiles:
        dq_t, dk_t, dv_t = _block_backward(q5[..., rows, :], k5, v5, do5[..., rows, :], lse[..., rows],
                                           delta[..., rows], scale, _rows(mask, rows))
        dq.append(dq_t)
        dk, dv = dk + dk_t, dv + dv_t
    return torch.cat(dq, dim=-2), dk, dv


def _block_backward(q5, k5, v5, do5, lse, delta, scale, mask):
    s = block_scores(q5, k5, scale, mask)
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.to(do5.dtype).transpose(-1, -2), do5).float().sum(dim=2)
    dp = torch.matmul(do5, v5.transpose(-1, -2)).float()
    ds = (p * (dp - delta.unsqueeze(-1))).to(q5.dtype)
    dq = torch.matmul(ds, k5).float() * scale
    dk = torch.matmul(ds.transpose(-1, -2), q5).float().sum(dim=2) * scale
    return dq, dk, dv
