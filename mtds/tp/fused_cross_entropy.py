"""The vocab-parallel cross entropy in torch.compile'd pieces (``--cross-entropy-loss-fusion``).

Per row (token) i of this rank's logits z [N, W] -- vocabulary ids start .. start + W, of which the first
``width`` are real and the rest padding, treated as -inf:

    m_i    = max_j z_ij                                   all-reduce MAX over the TP group
    S_i    = sum_j exp(z_ij - m_i)                        } one all-reduce SUM of the two, stacked (as
    T_i    = z_i,target_i - m_i  (0 off this rank's ids)  }   Megatron-core's fused loss; the default path: two)
    loss_i = log S_i - T_i                                0 where target_i == ignore_index
    d loss_i / d z_ij = exp(z_ij - m_i) / S_i - [j == target_i]

The arithmetic is float32 whatever the logits' dtype, but no float32 tensor of the logits' size is made:
backward keeps the logits themselves (not a softmax) and the per-row m, S, and writes the gradient once, in
the logits' dtype. Each piece is one Inductor graph (on CPU a fused C++ loop, on CUDA Triton kernels), traced
with static shapes, once per shape; the collectives run between the pieces, in Python, so no piece breaks its
graph. At t = 1 the forward is one piece and there is no collective. Counts, tolerances and compile times on
CPU: docs/training.md.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from mtds.tp.layers import tp_world_and_rank

REDUCTIONS = ("none", "sum", "mean")


def _rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits as [N, W] and the column ids 0..W-1."""
    rows = logits.reshape(-1, logits.shape[-1])
    return rows, torch.arange(rows.shape[-1], device=rows.device)


def _local_max(logits, width: int):
    """This rank's row max over its real columns, float32 (a max of 16-bit values is one of them: exact)."""
    rows, col = _rows(logits)
    return torch.where(col < width, rows, float("-inf")).amax(dim=-1).float()


def _sums(logits, row_max, target, start: int, width: int, ignore_index: int):
    """[2, N]: S_i and T_i, read in one pass over the logits (the target picked by a compare, not a gather, so
    it joins the exponentials' loop)."""
    rows, col = _rows(logits)
    tgt = target.reshape(-1)
    shifted = rows.float() - row_max.unsqueeze(-1)
    sum_exp = torch.where(col < width, shifted.exp(), 0.0).sum(dim=-1)
    hit = (col == (tgt - start).unsqueeze(-1)) & (tgt != ignore_index).unsqueeze(-1)
    picked = torch.where(hit, shifted, 0.0).sum(dim=-1)
    return torch.stack([sum_exp, picked])


def _loss(stats, target, ignore_index: int, reduction: str):
    tgt = target.reshape(-1)
    kept = tgt != ignore_index
    losses = torch.where(kept, stats[0].log() - stats[1], 0.0)
    if reduction == "none":
        return losses.view(target.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / kept.sum().clamp(min=1)


def _forward_local(logits, target, width: int, ignore_index: int, reduction: str):
    """t = 1: the three steps in one graph, no collective between them."""
    row_max = _local_max(logits, width)
    stats = _sums(logits, row_max, target, 0, width, ignore_index)
    return _loss(stats, target, ignore_index, reduction), row_max, stats


def _grad(logits, row_max, stats, target, grad_out, start: int, width: int, ignore_index: int, reduction: str):
    """(softmax - one_hot(target)) times the loss gradient per row, in the logits' dtype."""
    rows, col = _rows(logits)
    tgt = target.reshape(-1)
    kept = tgt != ignore_index
    shifted = rows.float() - row_max.unsqueeze(-1)
    softmax = torch.where(col < width, shifted.exp() / stats[0].unsqueeze(-1), 0.0)
    hit = (col == (tgt - start).unsqueeze(-1)) & kept.unsqueeze(-1)
    if reduction == "none":
        scale = grad_out.reshape(-1)
    elif reduction == "sum":
        scale = grad_out.expand(tgt.shape)
    else:
        scale = (grad_out / kept.sum().clamp(min=1)).expand(tgt.shape)
    scale = torch.where(kept, scale.float(), 0.0)
    return ((softmax - hit.float()) * scale.unsqueeze(-1)).to(logits.dtype).view(logits.shape)


class Pieces(NamedTuple):
    local: object       # _forward_local
    max: object         # _local_max
    sums: object        # _sums
    loss: object        # _loss
    grad: object        # _grad


@functools.lru_cache(maxsize=None)
def pieces(backend: str = "inductor") -> Pieces:
    """The pieces compiled with ``backend`` (one set per backend for the process); "inductor" is what
    ``impl="native"`` runs. Dynamo keeps a graph per shape, dtype and constant (a run has one of each); past its
    recompile_limit (8) of them a piece runs eagerly -- the same values, unfused -- where ``fullgraph`` would
    raise. tests/test_fused_cross_entropy.py holds each piece to one graph."""
    def compiled(fn):
        return torch.compile(fn, backend=backend, dynamic=False)
    return Pieces(*map(compiled, (_forward_local, _local_max, _sums, _loss, _grad)))


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(x, op=op, group=group)
    return x


class FusedCrossEntropy(torch.autograd.Function):
    """``apply(logits, target, group, vocab_size, ignore_index, reduction, pieces)``: the loss reduced as
    ``reduction`` asks (float32); the gradient of the logits in their dtype."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index, reduction, fns):
        world, rank = tp_world_and_rank(group)
        per_rank = logits.shape[-1]
        start = rank * per_rank
        width = per_rank if vocab_size is None else max(0, min(per_rank, vocab_size - start))
        if world == 1:
            out, row_max, stats = fns.local(logits, target, width, ignore_index, reduction)
        else:
            row_max = _all_reduce(fns.max(logits, width), group, dist.ReduceOp.MAX)
            stats = _all_reduce(fns.sums(logits, row_max, target, start, width, ignore_index), group)
            out = fns.loss(stats, target, ignore_index, reduction)
        ctx.save_for_backward(logits, row_max, stats, target)
        ctx.consts = (start, width, ignore_index, reduction, fns)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, row_max, stats, target = ctx.saved_tensors
        start, width, ignore_index, reduction, fns = ctx.consts
        grad = fns.grad(logits, row_max, stats, target, grad_out, start, width, ignore_index, reduction)
        return grad, None, None, None, None, None, None


def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None, *, vocab_size: int | None = None,
                        ignore_index: int = -100, reduction: str = "mean", backend: str = "inductor") -> torch.Tensor:
    """:func:`mtds.tp.cross_entropy.vocab_parallel_cross_entropy`'s values by the fused pieces; ``backend``:
    torch.compile's (tests run the same functions under "aot_eager", which compiles in a fraction of the time
    but fuses nothing)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return FusedCrossEntropy.apply(logits, target, group, vocab_size, ignore_index, reduction, pieces(backend))
