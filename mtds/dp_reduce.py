"""Data-parallel gradient reduce-scatter at the ring minimum: each rank ends with the sum of its 1/d
partition of a flat gradient buffer, and puts (d-1)/d of the buffer on its link (``mtds.ring``), half
of an all-reduce's 2(d-1)/d.

NCCL (and any backend with a real one) runs ``reduce_scatter_tensor``. gloo has none of its own: torch
runs its reduce-scatter as an all-reduce and keeps the shard (the all-reduce's bytes, measured on the
emulated cluster, docs/cluster.md). On gloo this module runs the ring algorithm itself (Patarasuk & Yuan
2009) over point-to-point messages: d-1 steps, in each of which every rank sends one partial partition to
the next rank of the group and adds the one it receives from the previous rank; after the last step rank
r holds partition r summed over all ranks. Each rank sends (d-1)/d of the buffer, all of it to its ring
neighbour, so the bytes on every link are the ring's.

Work goes in buckets of at most ``bucket_elements`` per partition, so a large model needs only one bucket
of scratch memory. A reduction may cover only some ranges of each partition (the same ranges of
partition c on every rank; other partitions may have others), so that a pipeline stage can reduce the
gradients that are final before those a later collective still changes (the tied embedding's).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

Ranges = list[list[tuple[int, int]]]    # per partition c: (offset, length) pairs inside it


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


def reduce_scatter_sum(flat: torch.Tensor, out: torch.Tensor, group, *, bucket_elements: int,
                       ranges: Ranges | None = None) -> None:
    """``out`` (numel P) at ``ranges[r]`` = the sum over the group's d ranks of their ``flat[r*P:(r+1)*P]``
    at those ranges, r this rank's index in ``group`` (all ranges when None); ``flat`` holds d*P elements
    and may be overwritten (scratch)."""
    d, r = dist.get_world_size(group), dist.get_rank(group)
    size = out.numel()
    if flat.numel() != d * size:
        raise ValueError(f"reduce_scatter_sum: {flat.numel()} elements do not split into {d} partitions of {size}")
    ranges = whole(d, size) if ranges is None else ranges
    if d == 1:
        for offset, length in ranges[0]:
            out.narrow(0, offset, length).copy_(flat.narrow(0, offset, length))
        return
    shards = flat.view(d, size)
    # chunk c: partition c's ranges, contiguous (a view when it is the whole partition)
    chunks = [_gather(shards[c], ranges[c]) for c in range(d)]
    mine = torch.empty_like(chunks[r])
    native = dist.get_backend(group) != "gloo"
    ring = None if native else _Ring(group)
    step = max(1, int(bucket_elements))
    longest = max(chunk.numel() for chunk in chunks)
    for start in range(0, longest, step):
        pieces = [chunk[start:start + step] for chunk in chunks]    # shorter chunks: shorter or empty pieces
        target = mine[start:start + step]
        if native:
            _padded_reduce_scatter(pieces, target, group)
        else:
            ring.reduce_scatter(pieces, target)
    _scatter(mine, out, ranges[r])


def _gather(partition: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    if len(ranges) == 1 and ranges[0] == (0, partition.numel()):
        return partition
    if not ranges:
        return partition[:0]
    return torch.cat([partition.narrow(0, offset, length) for offset, length in ranges])


def _scatter(values: torch.Tensor, out: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
    at = 0
    for offset, length in ranges:
        out.narrow(0, offset, length).copy_(values.narrow(0, at, length))
        at += length


def _padded_reduce_scatter(pieces: list[torch.Tensor], target: torch.Tensor, group) -> None:
    """A backend's own reduce-scatter takes equal pieces: pad each to the longest (zeros add nothing)."""
    n = max(piece.numel() for piece in pieces)
    send = torch.zeros(len(pieces), n, dtype=target.dtype, device=target.device)
    for c, piece in enumerate(pieces):
        send[c, :piece.numel()].copy_(piece)
    send = send.view(-1)
    result = torch.empty(n, dtype=target.dtype, device=target.device)
    dist.reduce_scatter_tensor(result, send, group=group)
    target.copy_(result[:target.numel()])


class _Ring:
    """This rank's place in the group's ring: the next rank (sent to) and the previous (received from)."""

    def __init__(self, group):
        self.group, self.d, self.r = group, dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.r + 1) % self.d)
        self.prev = dist.get_global_rank(group, (self.r - 1) % self.d)

    def reduce_scatter(self, pieces: list[torch.Tensor], target: torch.Tensor) -> None:
        """``target`` = the sum over ranks of their ``pieces[r]``; ``pieces`` are summed into in place.
        Step k sends the partial sum of piece r-k-1 and adds the previous rank's of piece r-k-2; every
        rank knows every piece's length, so an empty piece is skipped on both sides."""
        d, r = self.d, self.r
        for k in range(d - 1):
            out_piece, in_piece = pieces[(r - k - 1) % d], pieces[(r - k - 2) % d]
            ops = []
            if out_piece.numel():
                ops.append(dist.P2POp(dist.isend, out_piece.contiguous(), self.next, group=self.group))
            incoming = torch.empty_like(in_piece)
            if in_piece.numel():
                ops.append(dist.P2POp(dist.irecv, incoming, self.prev, group=self.group))
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            in_piece.add_(incoming)
        target.copy_(pieces[r])
