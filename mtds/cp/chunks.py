"""Which tokens of the sequence a context-parallel rank holds (causal load balancing).

With causal attention, token t attends to t + 1 keys, so cutting the sequence into C contiguous
parts would give the last rank ~2C−1 times the work of the first. Instead the sequence of length s
is cut into 2·C equal chunks of s/(2C) tokens and rank i holds chunk i followed by chunk 2C−1−i
(Megatron's order): every rank then holds one early and one late chunk, and the pairs' costs sum to
the same total.

    local_positions(s, C, i) = [i·m, …, (i+1)·m − 1] ++ [(2C−1−i)·m, …, (2C−i)·m − 1],   m = s/(2C)

Concatenating the ranks' local parts in rank order gives the sequence in the order
``concat_i local_positions(s, C, i)``; :func:`gather_order` is the permutation back to natural order.
"""
from __future__ import annotations

import torch

from mtds.parallel.cp_rules import chunks_problem


class ContextParallelError(ValueError):
    """A context-parallel setting that cannot work; the message says what to change."""


def check_cp_sequence(seq_length: int, cp: int) -> None:
    """Refuse a sequence that does not cut into 2·C equal chunks (nothing to check at C = 1)."""
    if cp < 1:
        raise ContextParallelError(f"--context-parallel-size must be at least 1, got {cp}")
    problem = chunks_problem(seq_length, cp)
    if problem is not None:
        raise ContextParallelError(problem.train_message())


def local_positions(seq_length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions (int64, [seq_length // cp]) of the tokens rank ``rank`` holds, in its local order."""
    if cp == 1:
        return torch.arange(seq_length, device=device)
    check_cp_sequence(seq_length, cp)
    if not 0 <= rank < cp:
        raise ContextParallelError(f"context-parallel rank {rank} is outside 0..{cp - 1}")
    m = seq_length // (2 * cp)
    first = torch.arange(rank * m, (rank + 1) * m, device=device)
    second = torch.arange((2 * cp - 1 - rank) * m, (2 * cp - rank) * m, device=device)
    return torch.cat([first, second])


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (the full sequence there), contiguous."""
    if cp == 1:
        return x.contiguous()
    seq_length = x.shape[dim]
    check_cp_sequence(seq_length, cp)
    m = seq_length // (2 * cp)
    # Two narrow()s instead of an index_select: views, then one copy in the cat.
    return torch.cat([x.narrow(dim, rank * m, m), x.narrow(dim, (2 * cp - 1 - rank) * m, m)], dim=dim).contiguous()


def gather_order(seq_length: int, cp: int, device=None) -> torch.Tensor:
    """``perm`` with ``concat_r(part_r)[..., perm, ...]`` in natural order (int64, [seq_length]).

    ``concat`` is the ranks' local parts one after another (rank 0's first); the tokens at
    ``concat`` index j have global position ``held[j]``, and ``perm = argsort(held)``.
    """
    return torch.argsort(held_order(seq_length, cp, device=device))


def held_order(seq_length: int, cp: int, device=None) -> torch.Tensor:
    """Inverse of :func:`gather_order`: ``natural[..., held, ...]`` is the ranks' parts concatenated
    (``held[j]`` = global position of the j-th token of that concatenation)."""
    return torch.cat([local_positions(seq_length, cp, r, device=device) for r in range(cp)])


def check_attention_shapes(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q [b, hq, sl, d] and k, v [b, hkv, sl, d] with hq a multiple of hkv (GQA), as both kernels take them."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ContextParallelError(f"{name} needs q [b, hq, sl, d] and k, v [b, hkv, sl, d], got "
                                   f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ContextParallelError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
