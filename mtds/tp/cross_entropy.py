"""Cross entropy over vocab-sharded logits without ever materialising the full vocabulary.

Per token: loss = log(sum_j exp(z_j - m)) - (z_target - m), with m the global max. Each rank holds
a slice of the vocabulary, so we all-reduce three small [b, s] tensors (max, the target logit, the
sum of exponentials) instead of gathering [b, s, V] logits. The shift, the exponentials and the softmax
saved for backward share one float32 buffer of the logits' size: the logits' own where the caller gives
them up (``reuse_logits``), else a new one. Padded vocabulary columns (ids >=
``vocab_size``) are set to -inf so they never take probability mass.

16-bit logits (bf16/fp16) take another path, :class:`_ChunkedCrossEntropy16`: no float32 copy of the
logits at all. The max and the target logit are read off the 16-bit logits exactly; the exponentials are
summed a block of rows at a time in float32 (at least ``_CHUNK_ELEMENTS`` per block, at most ``_MAX_BLOCKS``
blocks) and recomputed the same way in
backward, which writes the 16-bit gradient once. Per element it is the float32 path's arithmetic in the
same order, so the values equal it; at b = 8, s = 1024, V = 50304 it spares a 1.6 GB float32 buffer and
its passes (the H100 profile of 2026-11-24).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mtds.tp.fused_cross_entropy import fused_cross_entropy
from mtds.tp.layers import tp_world_and_rank


def _vocab_range(logits: torch.Tensor, group) -> tuple[int, int]:
    _, rank = tp_world_and_rank(group)
    per_rank = logits.shape[-1]
    return rank * per_rank, (rank + 1) * per_rank


def _mask_padding(logits: torch.Tensor, start: int, vocab_size: int | None) -> torch.Tensor:
    if vocab_size is None or start + logits.shape[-1] <= vocab_size:
        return logits
    valid = torch.arange(start, start + logits.shape[-1], device=logits.device) < vocab_size
    return logits.masked_fill(~valid, float("-inf"))


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index, reuse_logits):
        start, end = _vocab_range(logits, group)
        ctx.input_dtype = logits.dtype
        # One [b, s, V/t] float32 buffer for everything below: the upcast or the padding mask when either
        # copies, else the logits' own (reuse_logits) or the shift's; then the exponentials in place.
        work = _mask_padding(logits.float(), start, vocab_size)

        # Subtract the global max for stability; the max needs no gradient. amax, not max(dim): the same
        # values without the argmax indices (1024 x 8192 fp32 on one core: 0.9 instead of 4.0 ms).
        logits_max = _all_reduce(work.amax(dim=-1), group, dist.ReduceOp.MAX)
        if work is logits and not reuse_logits:
            shifted = work - logits_max.unsqueeze(-1)
        else:
            shifted = work.sub_(logits_max.unsqueeze(-1))

        ignored = target == ignore_index
        outside = (target < start) | (target >= end) | ignored
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = _all_reduce(target_logit, group)

        exp = shifted.exp_()          # shifted is read above (target logits) and not after
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        grad = softmax  # d loss / d z = softmax - one_hot(target); reuse the buffer
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None, None


_CHUNK_ELEMENTS = 1 << 24      # float32 elements of one block of rows: at least 64 MiB of scratch ...
# ... and at most 4 blocks: each block is ~15 kernel launches forward and backward, and a launch costs the
# step loop ~47 us of host time on an H200 (gpu-bench, 2026-11-26). With 64 MiB blocks gpt2-medium at b = 8
# (8192 rows of 50304) ran 25 blocks, and the step was 10 % slower than the float32 copy's (paired A/B).
# Four blocks keep the float32 scratch at a quarter of the copy's size.
_MAX_BLOCKS = 4

# Off by default: measured on an H200 (gpu-bench 2026-11-26, gpt2-medium s = 1024 b = 8, bf16, paired A/B
# alternated step by step) the float32 copy's path was faster -- this path's step took 1/0.90 as long with
# 64 MiB blocks (25 of them) and 1/0.947 with at most 4 blocks: at this size the step is launch-bound and
# the copy costs bandwidth the GPU has to spare. What this path saves is memory (the 1.6 GB float32 copy at
# b = 8, 13 GB at b = 64). A fused kernel would give both: FUSED below, which gpu_bench's A/B now measures instead.
CHUNKED_16BIT = False

# Bench-only switch (benchmarks/gpu_bench.py's A/B sets it): what ``impl=None`` runs. Off: the fused path
# (mtds.tp.fused_cross_entropy) is unmeasured on a GPU. train.py's --cross-entropy-loss-fusion passes ``impl``.
FUSED = False


def _row_blocks(rows: int, width: int):
    step = max(1, _CHUNK_ELEMENTS // max(1, width), -(-rows // _MAX_BLOCKS))
    return ((i, min(i + step, rows)) for i in range(0, rows, step))


class _ChunkedCrossEntropy16(torch.autograd.Function):
    """The cross entropy of 16-bit vocab-sharded logits with float32 arithmetic and no float32 copy of them.
    Padded vocabulary columns are -inf in every block, as in the float32 path (so each row's sum runs over
    the same elements in the same order: equal values)."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index):
        start, end = _vocab_range(logits, group)
        width = logits.shape[-1] if vocab_size is None else max(0, min(logits.shape[-1], vocab_size - start))
        rows, tgt = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
        # the max of 16-bit values is one of them: exact without an upcast
        logits_max = _all_reduce(rows[:, :width].amax(dim=-1).float() if width else
                                 torch.full((rows.shape[0],), float("-inf"), device=rows.device), group,
                                 dist.ReduceOp.MAX)
        ignored = tgt == ignore_index
        outside = (tgt < start) | (tgt >= end) | ignored
        local_target = (tgt - start).masked_fill(outside, 0)
        picked = rows.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) if width else logits_max
        target_logit = _all_reduce((picked.float() - logits_max).masked_fill(outside, 0.0), group)
        sum_exp = torch.zeros_like(logits_max)
        for i, j in _row_blocks(rows.shape[0], rows.shape[1]):
            sum_exp[i:j] = _shifted_exp(rows[i:j], width, logits_max[i:j]).sum(dim=-1)
        sum_exp = _all_reduce(sum_exp, group)
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(logits, logits_max, sum_exp, local_target, outside, ignored)
        ctx.width = width
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, logits_max, sum_exp, local_target, outside, ignored = ctx.saved_tensors
        rows = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty_like(logits)
        grad_rows = grad.view(-1, logits.shape[-1])
        scale = grad_loss.reshape(-1) * (~ignored).float()
        hit = (~outside).float().unsqueeze(-1)
        for i, j in _row_blocks(rows.shape[0], rows.shape[1]):
            # d loss / d z = softmax - one_hot(target), as the float32 path computes it
            block = _shifted_exp(rows[i:j], ctx.width, logits_max[i:j]).div_(sum_exp[i:j].unsqueeze(-1))
            block.scatter_add_(-1, local_target[i:j].unsqueeze(-1), -hit[i:j])
            grad_rows[i:j] = block.mul_(scale[i:j].unsqueeze(-1))
        return grad, None, None, None, None


def _shifted_exp(rows: torch.Tensor, width: int, row_max: torch.Tensor) -> torch.Tensor:
    """exp(z - max) of a block of 16-bit rows in float32, padded columns (from ``width`` on) exp(-inf) = 0."""
    block = rows.float()
    if width < block.shape[-1]:
        block[:, width:] = float("-inf")
    return block.sub_(row_max.unsqueeze(-1)).exp_()


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None, *,
                                 vocab_size: int | None = None, ignore_index: int = -100,
                                 reduction: str = "mean", reuse_logits: bool = False,
                                 impl: str | None = None) -> torch.Tensor:
    """Cross entropy of vocab-sharded ``logits`` [..., V_pad/t] against ``target`` [...].

    ``reuse_logits``: the caller never reads ``logits`` again (nor does autograd: no other operation saved
    them), so their buffer may hold the shifted logits, exponentials and softmax (Megatron does so): no
    float32 buffer of their size is allocated for fp32 logits. Otherwise ``logits`` are left untouched.
    ``reduction``: "none" (per token, 0 where ignored), "sum", or "mean" over non-ignored tokens.
    The result dtype is float32 whatever the logits dtype (bf16 logits lose too much in log-sum-exp).
    ``impl``: None, this module's paths; "native", the fused torch.compile'd one
    (:mod:`mtds.tp.fused_cross_entropy`: no float32 copy, one all-reduce fewer; ``reuse_logits`` moot).
    """
    if impl is None and FUSED:
        impl = "native"
    if impl is not None:
        if impl != "native":
            raise ValueError(f"cross entropy impl must be 'native' (or None), got {impl!r}")
        return fused_cross_entropy(logits, target, group, vocab_size=vocab_size, ignore_index=ignore_index,
                                   reduction=reduction)
    if CHUNKED_16BIT and logits.dtype in (torch.bfloat16, torch.float16):
        losses = _ChunkedCrossEntropy16.apply(logits, target, group, vocab_size, ignore_index)
    else:
        losses = _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, ignore_index, reuse_logits)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        count = (target != ignore_index).sum().clamp(min=1)
        return losses.sum() / count
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def gather_vocab_parallel_logits(logits: torch.Tensor, group, vocab_size: int | None = None) -> torch.Tensor:
    """Full logits [..., V] from vocab shards (evaluation and parity checks only: costs b*s*V memory)."""
    world, _ = tp_world_and_rank(group)
    if world > 1:
        parts = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    return logits if vocab_size is None else logits[..., :vocab_size]
