"""Build one rank's shard of a tensor-parallel weight with exactly the values a full-tensor fill gives,
holding only the shard and one bounded chunk -- never the full (unsharded) matrix.

Why it is exact: torch's CPU ``normal_`` on a contiguous float32 tensor of n >= 16 elements draws n
uniforms from the generator (mt19937, one 32-bit draw each), turns each aligned group of 16 into 16
normals (Box-Muller), and, when n is not a multiple of 16, draws 16 more uniforms for the last 16
elements. So filling row chunks of the full tensor one after another, every chunk a multiple of 16
elements except the last (which is >= 16), produces the same values and leaves the generator in the same
state as one fill of the whole tensor. A chunk that holds none of this rank's rows need not be
transformed at all: ``uniform_`` advances mt19937 by the same draws at about twice the speed.

Cost per rank (one core here: normal_ ~235 M elements/s, uniform_ ~510 M/s): memory O(shard + chunk);
generator time O(full tensor), because mt19937 cannot jump ahead cheaply. A stage of 22 B parameters
(175 B at p = 8) spends ~50 s drawing at t = 8 (rows kept by the rank transformed, the rest skipped).
Reaching O(shard) time would need a counter-based (sliceable) generator, i.e. different initial values.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

# Box-Muller works on aligned groups of this many elements (see the module docstring).
_GROUP = 16
DEFAULT_CHUNK_ELEMENTS = 16 * 1024 * 1024      # 64 MiB of float32 per chunk


def shard_rows(full: torch.Tensor, dim: int, world: int, rank: int,
               segments: Sequence[int] | None = None) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim``; each segment (e.g. q|k|v) is split separately."""
    ranges = kept_row_ranges(full.shape[dim], world, rank, segments, dim=dim)
    return torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()


class NormalInit:
    """``normal_(mean, std)`` as an init method mtds can fill chunk by chunk (see the module docstring).

    Any other callable still works as an init method; it is applied to the full tensor, as before."""

    def __init__(self, std: float, mean: float = 0.0):
        self.std, self.mean = float(std), float(mean)

    def __call__(self, tensor: torch.Tensor) -> None:
        nn.init.normal_(tensor, mean=self.mean, std=self.std)

    def __repr__(self) -> str:
        return f"NormalInit(std={self.std}, mean={self.mean})"


def kept_row_ranges(rows: int, world: int, rank: int, segments: Sequence[int] | None,
                    dim: int = 0) -> list[tuple[int, int]]:
    """The full tensor's rows (indices along ``dim``, of which it has ``rows``) this rank keeps, in the
    order its shard stores them (ascending): each segment split into ``world`` equal parts."""
    segments = list(segments) if segments else [rows]
    if sum(segments) != rows:
        raise ValueError(f"segments {segments} do not add up to dim {dim} of size {rows}")
    ranges, start = [], 0
    for size in segments:
        if size % world:
            raise ValueError(f"size {size} is not divisible by tensor parallel size {world}")
        step = size // world
        ranges.append((start + rank * step, start + (rank + 1) * step))
        start += size
    return ranges


def _chunk_rows(row_elements: int, chunk_elements: int) -> int:
    """Rows per chunk: a multiple of the rows that make a whole number of 16-element groups."""
    unit = _GROUP // math.gcd(_GROUP, row_elements)
    return max(unit, (chunk_elements // max(row_elements, 1)) // unit * unit)


def _chunks(valid_rows: int, row_elements: int, chunk_elements: int) -> list[tuple[int, int]]:
    """Row chunks covering [0, valid_rows); a last chunk under 16 elements joins the one before it."""
    step = _chunk_rows(row_elements, chunk_elements)
    bounds = list(range(0, valid_rows, step)) + [valid_rows]
    if len(bounds) > 2 and (bounds[-1] - bounds[-2]) * row_elements < _GROUP:
        del bounds[-2]
    return list(zip(bounds, bounds[1:]))


def _local_row(kept: list[tuple[int, int]], row: int) -> int:
    """Where full-tensor row ``row`` (one this rank keeps) sits in the shard."""
    before = 0
    for a, b in kept:
        if a <= row < b:
            return before + row - a
        before += b - a
    raise ValueError(f"row {row} is not kept by this rank")


def build_shard(shape: Sequence[int], dim: int, world: int, rank: int, init, segments: Sequence[int] | None = None,
                valid_rows: int | None = None, chunk_elements: int | None = None,
                rows: tuple[int, int] | None = None) -> torch.Tensor:
    """This rank's float32 shard (``dim`` split ``world`` ways, each segment separately) of the tensor
    that ``init(full)`` would fill, where rows ``valid_rows:`` of dim 0 are zero and not drawn (the
    vocabulary padding). Bit-identical to filling the full tensor and slicing, for every ``world``.
    ``rows`` (with ``dim`` > 0): keep only dim 0's rows [a, b) as well (expert parallelism: this rank's
    experts of an [E, ...] tensor)."""
    shape = tuple(shape)
    n_rows = shape[0]
    valid = n_rows if valid_rows is None else valid_rows
    if rows is not None and dim == 0:
        raise ValueError("rows= selects dim 0 of a tensor split on another dim")
    row_elements = math.prod(shape[1:])
    if not isinstance(init, NormalInit) or valid * row_elements < _GROUP:
        full = torch.zeros(shape, dtype=torch.float32)
        init(full[:valid])        # what the full-tensor path always did
        if rows is not None:
            full = full[rows[0]:rows[1]]
        return shard_rows(full, dim, world, rank, segments)
    kept = kept_row_ranges(n_rows, world, rank, segments) if dim == 0 else [rows or (0, n_rows)]
    local_shape = list(shape)
    local_shape[dim] //= world
    local_shape[0] = sum(b - a for a, b in kept) if dim != 0 else local_shape[0]
    out = torch.zeros(local_shape, dtype=torch.float32)
    pieces = _chunks(valid, row_elements, chunk_elements or DEFAULT_CHUNK_ELEMENTS)
    for index, (r0, r1) in enumerate(pieces):
        overlaps = [(max(a, r0), min(b, r1)) for a, b in kept if max(a, r0) < min(b, r1)]
        n = (r1 - r0) * row_elements
        if not overlaps:            # advance the generator by the same draws without the transform
            tail = _GROUP if index == len(pieces) - 1 and n % _GROUP else 0
            torch.empty(n + tail, dtype=torch.float32).uniform_()
            continue
        chunk = torch.empty((r1 - r0, *shape[1:]), dtype=torch.float32)
        init(chunk)
        for a, b in overlaps:
            start = _local_row(kept, a)
            piece = chunk[a - r0:b - r0]
            out[start:start + (b - a)] = shard_rows(piece, dim, world, rank, segments) if dim != 0 else piece
    return out


__all__ = ["NormalInit", "build_shard", "shard_rows", "kept_row_ranges", "DEFAULT_CHUNK_ELEMENTS"]
