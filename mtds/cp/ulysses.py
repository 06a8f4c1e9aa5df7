"""Ulysses attention (``--cp-comm-type a2a``): trade the sequence split for a head split.

An all-to-all turns the C ranks' [b, sl, h, d] parts (sl = s/C local tokens, h heads) into
[b, s, h/C, d] (every token, a contiguous block of h/C heads on each rank), full attention runs
on those heads, and a second all-to-all goes back. The all-to-all stacks the ranks' tokens in rank
order, i.e. in the load-balanced order of :func:`mtds.cp.chunks.local_positions`, so the local
attention puts them in natural order first (:func:`mtds.cp.chunks.gather_order`) and back after
(:func:`mtds.cp.chunks.held_order`); the causal (or document) mask needs the natural order.
GQA: the head blocks of q (hq/C) and of k, v (hkv/C) line up because query head i uses kv head
i // (hq/hkv), so both counts must be multiples of C.

The all-to-alls are DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention`` (its
``_SeqAllToAll`` autograd function: the backward of an all-to-all is the opposite all-to-all),
with batch-first tensors (scatter_idx=2 heads, gather_idx=1 sequence, batch_dim_idx=0) and a
local attention that does the reordering and ``scaled_dot_product_attention``. It talks through
``deepspeed.comm``, so DeepSpeed's communication backend must be up (mtds's
:func:`mtds.training.distributed.init_distributed` does that; a bare ``torch.distributed``
process group is not enough). Checked on gloo: output and dq/dk/dv equal dense SDPA
(tests/test_cp_attention.py). Its GQA handling splits q's heads by the kv-head count's blocks,
which for counts divisible by C is the plain contiguous split used here; its uneven-head path
(hkv % C != 0) is never reached because such counts are refused first.
``_SeqAllToAll`` fills a fresh buffer through a collective inside an autograd function, the
pattern DeepSpeed's own ``_dim_zero_all_to_all`` docstring says torch.compile can trace into a
zero gradient; so ``ulysses_attention`` is ``torch.compiler.disable``d and runs eagerly inside a
compiled layer (checked against eager in the test).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mtds.cp.chunks import ContextParallelError, check_attention_shapes, check_cp_sequence, gather_order, held_order
from mtds.parallel.cp_rules import heads_problem


def check_ulysses_heads(q_heads: int, kv_heads: int, cp: int) -> None:
    """Refuse head counts the all-to-all cannot split evenly."""
    problem = heads_problem(q_heads, kv_heads, cp)
    if problem is not None:
        raise ContextParallelError(problem.train_message())


def _document_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] boolean: key j visible to query i iff j ≤ i and both are in the same document."""
    s = segments.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    return (causal & (segments.unsqueeze(-1) == segments.unsqueeze(-2))).unsqueeze(1)


def local_causal_attention(q, k, v, *, segments=None, scale=None):
    """SDPA of [b, h, s, d] tensors in natural order: causal, or causal within documents."""
    gqa = q.shape[1] != k.shape[1]
    if segments is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_document_causal_mask(segments), scale=scale,
                                          enable_gqa=gqa)


class _Reordered(torch.nn.Module):
    """The local attention DeepSpeed runs between its all-to-alls: [b, s, h/C, d] in rank-stacked
    order in and out, natural order (and heads second) inside."""

    def __init__(self, natural: torch.Tensor, stacked: torch.Tensor, segments, scale):
        super().__init__()
        self.natural, self.stacked, self.segments, self.scale = natural, stacked, segments, scale

    def forward(self, q, k, v):
        q, k, v = (t.index_select(1, self.natural).transpose(1, 2) for t in (q, k, v))
        out = local_causal_attention(q, k, v, segments=self.segments, scale=self.scale)
        return out.transpose(1, 2).index_select(1, self.stacked)


def _all_gather_segments(segments: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The document ids of the whole sequence [b, s], in rank-stacked order (int64, no gradient)."""
    parts = [torch.empty_like(segments) for _ in range(cp)]
    dist.all_gather(parts, segments.contiguous(), group=group)
    return torch.cat(parts, dim=1)


@torch.compiler.disable     # run eagerly inside a compiled layer: collectives split the graph anyway
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                      segments: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of the local load-balanced tokens against the whole sequence, by head all-to-all.

    Same contract as :func:`mtds.cp.ring.ring_attention`: q [b, hq, sl, d], k/v [b, hkv, sl, d],
    ``segments`` [b, sl] int64 document ids, ``scale`` default 1/√d; returns [b, hq, sl, d].
    Needs hq and hkv divisible by C.
    """
    check_attention_shapes("ulysses_attention", q, k, v)
    cp = dist.get_world_size(group) if dist.is_initialized() else 1
    check_ulysses_heads(q.shape[1], k.shape[1], cp)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if cp == 1:
        return local_causal_attention(q, k, v, segments=segments, scale=scale)
    seq = q.shape[2] * cp
    check_cp_sequence(seq, cp)
    import deepspeed.comm
    from deepspeed.sequence.layer import DistributedAttention
    if not deepspeed.comm.is_initialized():
        raise ContextParallelError("--cp-comm-type a2a runs on DeepSpeed's communication backend: call "
                                   "deepspeed.init_distributed (mtds.training.distributed.init_distributed) first")
    natural = gather_order(seq, cp, device=q.device)
    if segments is not None:
        segments = _all_gather_segments(segments, group, cp).index_select(1, natural)
    local = _Reordered(natural, held_order(seq, cp, device=q.device), segments, scale)
    group = group if group is not None else dist.group.WORLD
    attention = DistributedAttention(local, group, scatter_idx=2, gather_idx=1, num_kv_heads=k.shape[1])
    out = attention(*(t.transpose(1, 2) for t in (q, k, v)), 0)      # batch first: batch_dim_idx 0
    return out.transpose(1, 2)
