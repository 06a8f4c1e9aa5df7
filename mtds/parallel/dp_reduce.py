"""Data-parallel gradient reduce-scatter at the ring minimum: each rank ends with the sum of its 1/d
partition of a flat gradient buffer, and puts (d-1)/d of the buffer on its link (``mtds.parallel.ring``), half
of an all-reduce's 2(d-1)/d.

NCCL (and any backend with a real one) runs ``reduce_scatter_tensor``. gloo has none of its own: torch
runs its reduce-scatter as an all-reduce and keeps the shard (the all-reduce's bytes, measured on the
emulated cluster, docs/cluster.md). On gloo this module runs the ring algorithm itself (Patarasuk & Yuan
2009) over point-to-point messages: d-1 steps, in each of which every rank sends one partial partition to
the next rank of the group and adds the one it receives from the previous rank; after the last step rank
r holds partition r summed over all ranks. Each rank sends (d-1)/d of the buffer, all of it to its ring
neighbour, so the bytes on every link are the ring's.

The flat buffer need not exist: the caller may hand a ``fill`` function that writes any window of it,
and the work goes in buckets: bucket k is the same window [k*w, (k+1)*w) of every partition, so each
bucket's reduce-scatter delivers every rank exactly its own partition's window. With w =
bucket_elements // (d+1) the d windows and the one the ring receives into (or NCCL's output) fit in one
scratch tensor of at most ``bucket_elements`` elements, whatever the model's size. Which bucket an
element falls in does not change its sum: the ring adds partition c's values in the same rank order in
every bucket.

A reduction may cover only some ranges of each partition (the same ranges of partition c on every rank;
other partitions may have others), so that a pipeline stage can reduce the gradients that are final
before those a later collective still changes (the tied embedding's); the windows are then taken over
each partition's ranges laid end to end.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.distributed as dist

Ranges = list[list[tuple[int, int]]]    # per partition c: (offset, length) pairs inside it
Fill = Callable[[int, int, torch.Tensor], None]    # (partition c, offset in it, dest): this rank's values


def whole(d: int, size: int) -> Ranges:
    """Every element of every partition."""
    return [[(0, size)] for _ in range(d)]


def split_by_spans(spans: list[tuple[int, int]], d: int, size: int) -> tuple[Ranges, Ranges]:
    """(outside, inside): each partition's ranges outside / inside ``spans`` ([a, b) element spans of the
    flat buffer of d partitions of ``size``)."""
    inside: Ranges = [[] for _ in range(d)]
    for a, b in sorted(spans):
        for c in range(max(a, 0) // size, min((b - 1) // size, d - 1) + 1):
            lo, hi = max(a, c * size), min(b, (c + 1) * size)
            if hi > lo:
                inside[c].append((lo - c * size, hi - lo))
    outside: Ranges = []
    for pieces in inside:
        rest, at = [], 0
        for offset, length in sorted(pieces):
            if offset > at:
                rest.append((at, offset - at))
            at = max(at, offset + length)
        if at < size:
            rest.append((at, size - at))
        outside.append(rest)
    return outside, inside


def window(ranges: list[tuple[int, int]], start: int, width: int) -> list[tuple[int, int]]:
    """Positions [start, start + width) of ``ranges`` laid end to end, as (offset, length) ranges."""
    out, at = [], 0
    for offset, length in ranges:
        lo, hi = max(start, at), min(start + width, at + length)
        if hi > lo:
            out.append((offset + lo - at, hi - lo))
        at += length
        if at >= start + width:
            break
    return out


def buckets(ranges: Ranges, bucket_elements: int) -> Iterator[Ranges]:
    """The reduction's buckets: per bucket, each partition's ranges in it (the same window of every
    partition's ranges, w = bucket_elements // (d+1) long, at least 1: d windows and a receive buffer
    in ``bucket_elements``)."""
    d = len(ranges)
    width = max(1, int(bucket_elements) // (d + 1))
    longest = max(sum(length for _, length in rs) for rs in ranges)
    for start in range(0, longest, width):
        yield [window(rs, start, width) for rs in ranges]


def flat_fill(flat: torch.Tensor, size: int) -> Fill:
    """A whole flat buffer of partitions of ``size`` as a :data:`Fill`."""
    def fill(c: int, offset: int, dest: torch.Tensor) -> None:
        dest.copy_(flat.narrow(0, c * size + offset, dest.numel()))
    return fill


def reduce_scatter_sum(source: torch.Tensor | Fill, out: torch.Tensor, group, *, bucket_elements: int,
                       ranges: Ranges | None = None, dtype: torch.dtype | None = None,
                       post_scale: float | None = None, accumulate: bool = False) -> None:
    """``out`` (numel P) at ``ranges[r]`` = the sum over the group's d ranks of their values of partition
    r at those ranges, r this rank's index in ``group`` (all ranges when None). ``source``: this rank's
    flat buffer (d*P elements, read only; ``out`` may be its own partition r), or a :data:`Fill` writing
    any window of it on demand. ``dtype``: the buckets' (the communication's; ``out``'s when None);
    ``post_scale``: the sum multiplied by it in that dtype before it reaches ``out``; ``accumulate``: added to
    ``out`` there instead of written (ZeRO-2's per-micro-batch reduction into its partition)."""
    d, r = dist.get_world_size(group), dist.get_rank(group)
    size, dtype = out.numel(), out.dtype if dtype is None else dtype
    if isinstance(source, torch.Tensor):
        if source.numel() != d * size:
            raise ValueError(f"reduce_scatter_sum: {source.numel()} elements do not split into {d} partitions of {size}")
        source = flat_fill(source, size)
    ranges = whole(d, size) if ranges is None else ranges
    if d == 1 and dtype == out.dtype and post_scale is None and not accumulate:      # nothing to sum: straight into the partition
        for offset, length in ranges[0]:
            source(0, offset, out.narrow(0, offset, length))
        return
    native = d > 1 and dist.get_backend(group) != "gloo"
    ring = None if native or d == 1 else _Ring(group)
    scratch = None
    for windows in buckets(ranges, bucket_elements):
        counts = [sum(length for _, length in w) for w in windows]
        n = max(counts)
        if scratch is None:     # the first bucket is the longest: (d+1) n <= bucket_elements
            scratch = torch.empty((d + 1) * n, dtype=dtype, device=out.device)
        bucket = scratch[:d * n].view(d, n)         # row c: partition c's window, zero-padded to n
        pieces = [bucket[c, :counts[c]] for c in range(d)]
        for c in range(d):
            at = 0
            for offset, length in windows[c]:
                source(c, offset, pieces[c].narrow(0, at, length))
                at += length
        spare = scratch[d * n:d * n + n]
        if native:
            for c in range(d):      # a backend's own reduce-scatter takes equal pieces: zeros add nothing
                bucket[c, counts[c]:].zero_()
            # torch >= 2.13's name (the old one warns that it is deprecated), looked up per call for the tracer
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            reduce_scatter(spare, bucket.view(-1), group=group)
            mine = spare[:counts[r]]
        elif d > 1:
            ring.reduce_scatter(pieces, spare)
            mine = pieces[r]
        else:
            mine = pieces[0]
        if post_scale is not None:
            mine.mul_(post_scale)
        at = 0
        for offset, length in windows[r]:
            target, value = out.narrow(0, offset, length), mine.narrow(0, at, length)
            target.add_(value) if accumulate else target.copy_(value)
            at += length


class _Ring:
    """This rank's place in the group's ring: the next rank (sent to) and the previous (received from)."""

    def __init__(self, group):
        self.group, self.d, self.r = group, dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.r + 1) % self.d)
        self.prev = dist.get_global_rank(group, (self.r - 1) % self.d)

    def reduce_scatter(self, pieces: list[torch.Tensor], spare: torch.Tensor) -> None:
        """``pieces[r]`` becomes the sum over ranks of their ``pieces[r]`` (``pieces`` are summed into in
        place; ``spare``: a receive buffer as long as the longest piece). Step k sends the partial sum of
        piece r-k-1 and adds the previous rank's of piece r-k-2; every rank knows every piece's length, so
        an empty piece is skipped on both sides."""
        d, r = self.d, self.r
        for k in range(d - 1):
            out_piece, in_piece = pieces[(r - k - 1) % d], pieces[(r - k - 2) % d]
            ops = []
            if out_piece.numel():
                ops.append(dist.P2POp(dist.isend, out_piece, self.next, group=self.group))
            incoming = spare[:in_piece.numel()]
            if in_piece.numel():
                ops.append(dist.P2POp(dist.irecv, incoming, self.prev, group=self.group))
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            in_piece.add_(incoming)
