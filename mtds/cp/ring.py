"""Ring attention (``--cp-comm-type p2p``): causal attention over a sequence split across C ranks.

Rank r holds queries, keys and values of sl = s/C tokens, the load-balanced positions of
:func:`mtds.cp.chunks.local_positions`. K/V (with their document ids) travel the ring: at step j
rank r holds those of rank (r − j) mod C, computes that block and folds it into its output with the
online softmax of :mod:`mtds.cp.blocks`. The hop for step j+1 is started before step j's block is
computed, so the transfer overlaps the compute. Backward runs the same ring; the dK/dV
accumulators travel with K/V, one hop behind, so that after C hops each rank holds the whole
gradient of its own K/V. Nothing of size s×s exists: a block is at most sl×sl.

Which blocks are computed (m = s/(2C), rank r holds chunks r and 2C−1−r, the K/V of rank c ≠ r
hold chunks c and 2C−1−c; a query chunk sees a key chunk wholly if it is later, not at all if
earlier):
    c = r: both halves, causal mask from the positions (the only masked block);
    c < r: all local queries × the first half of the keys (chunk c), no causal mask;
    c > r: the second half of the queries (chunk 2C−1−r) × all keys, no causal mask.
So every remote block costs half a local block. Document ids (packed sequences) add the mask
"same document" to whatever is computed.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mtds.cp.blocks import block_backward, block_forward, merge
from mtds.cp.chunks import ContextParallelError, check_attention_shapes, check_cp_sequence, local_positions
from mtds.cp.exchange import RingHop

_ALL = slice(None)
_KV_TAG, _GRAD_TAG = 0, 8       # two hops can be in flight at once in backward


def _plan(rank: int, src: int, local_len: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal mask needed) of the block of rank ``src``'s K/V (see the module docstring)."""
    half = local_len // 2
    if src == rank:
        return _ALL, _ALL, True
    if src < rank:
        return _ALL, slice(0, half), False
    return slice(half, None), _ALL, False


def _mask(pos_q, pos_k, seg_q, seg_k, causal: bool):
    """[b or 1, 1, 1, n, m] boolean (True = attend), or None when every entry attends."""
    mask = None
    if causal:
        mask = (pos_q.unsqueeze(-1) >= pos_k.unsqueeze(0))[None, None, None]
    if seg_q is not None:
        same = (seg_q.unsqueeze(-1) == seg_k.unsqueeze(-2))[:, None, None]
        mask = same if mask is None else mask & same
    return mask


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, segments, group, scale):
        ring = RingHop(group)
        b, hq, sl, d = q.shape
        hkv = k.shape[1]
        q5 = q.view(b, hkv, hq // hkv, sl, d)
        pos = local_positions(sl * ring.size, ring.size, ring.rank, device=q.device)
        out = lse = None
        kv, seg_k = torch.stack([k, v]), segments
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = None
            if step < ring.size - 1:       # start the next hop before computing this block
                pending = ring.start([kv] + ([seg_k] if segments is not None else []), tag=_KV_TAG)
            rows, cols, causal = _plan(ring.rank, src, sl)
            pos_k = local_positions(sl * ring.size, ring.size, src, device=q.device)
            mask = _mask(pos[rows], pos_k[cols], None if segments is None else segments[:, rows],
                         None if segments is None else seg_k[:, cols], causal)
            out_blk, lse_blk = block_forward(q5[..., rows, :], kv[0].unsqueeze(2)[..., cols, :],
                                             kv[1].unsqueeze(2)[..., cols, :], scale, mask)
            if out is None:                # step 0: the own block, where every token sees itself
                out, lse = out_blk, lse_blk
            else:
                merge(out[..., rows, :], lse[..., rows], out_blk, lse_blk)
            if pending is not None:
                received = pending.wait()
                kv = received[0]
                seg_k = received[1] if segments is not None else None
        out = out.to(q.dtype).view(b, hq, sl, d)
        ctx.save_for_backward(q, k, v, out, lse, segments)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, segments = ctx.saved_tensors
        ring = RingHop(ctx.group)
        scale = ctx.scale
        b, hq, sl, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        q5 = q.view(b, hkv, g, sl, d)
        do5 = grad_out.contiguous().view(b, hkv, g, sl, d)
        delta = (grad_out.float() * out.float()).sum(-1).view(b, hkv, g, sl)      # D = rowsum(dO ∘ O)
        pos = local_positions(sl * ring.size, ring.size, ring.rank, device=q.device)
        dq = torch.zeros(b, hkv, g, sl, d, dtype=torch.float32, device=q.device)
        kv, seg_k = torch.stack([k, v]), segments
        dkv = torch.zeros(2, b, hkv, sl, d, dtype=torch.float32, device=q.device)     # for the K/V held now
        grad_hop = None
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            kv_hop = None
            if step < ring.size - 1:
                kv_hop = ring.start([kv] + ([seg_k] if segments is not None else []), tag=_KV_TAG)
            rows, cols, causal = _plan(ring.rank, src, sl)
            pos_k = local_positions(sl * ring.size, ring.size, src, device=q.device)
            mask = _mask(pos[rows], pos_k[cols], None if segments is None else segments[:, rows],
                         None if segments is None else seg_k[:, cols], causal)
            dq_blk, dk_blk, dv_blk = block_backward(
                q5[..., rows, :], kv[0].unsqueeze(2)[..., cols, :], kv[1].unsqueeze(2)[..., cols, :],
                do5[..., rows, :], lse[..., rows], delta[..., rows], scale, mask)
            dq[..., rows, :] += dq_blk
            if grad_hop is not None:       # the accumulator of rank src, one hop behind its K/V
                dkv = grad_hop.wait()[0]
            dkv[0][..., cols, :] += dk_blk
            dkv[1][..., cols, :] += dv_blk
            if ring.size > 1:
                grad_hop = ring.start([dkv], tag=_GRAD_TAG)
            if kv_hop is not None:
                received = kv_hop.wait()
                kv = received[0]
                seg_k = received[1] if segments is not None else None
        if grad_hop is not None:           # the last hop brings this rank its own dK/dV
            dkv = grad_hop.wait()[0]
        return (dq.to(q.dtype).view(b, hq, sl, d), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None)


@torch.compiler.disable     # run eagerly inside a compiled layer: collectives split the graph anyway
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                   segments: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of the local load-balanced tokens against the whole sequence (see the module docstring).

    q [b, hq, sl, d], k/v [b, hkv, sl, d] with hq % hkv == 0 (GQA); ``segments`` [b, sl] int64 document
    ids of the local tokens (a token attends to earlier-or-same-position tokens of its own document);
    ``scale`` defaults to 1/√d. Returns [b, hq, sl, d] in q's dtype. No dropout.
    """
    check_attention_shapes("ring_attention", q, k, v)
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    check_cp_sequence(q.shape[2] * size, size)
    if segments is not None and segments.shape != (q.shape[0], q.shape[2]):
        raise ContextParallelError(f"segments must be [b, sl] = {(q.shape[0], q.shape[2])}, "
                                   f"got {tuple(segments.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                None if segments is None else segments.contiguous(), group, scale)
