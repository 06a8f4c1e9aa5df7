"""Data-parallel gradient reduce-scatter at the ring minimum: each rank ends with the sum of its 1/d
partition of a flat gradient buffer, and puts (d-1)/d of the buffer on its link (``mtds.ring``), half
of an all-reduce's 2(d-1)/d.

NCCL (and any backend with a real one) runs ``reduce_scatter_tensor``. gloo has none of its own: torch
runs its reduce-scatter as an all-reduce and keeps the shard (the all-reduce's bytes, measured on the
emulated cluster, docs/cluster.md), so on gloo each rank sends every other rank that rank's partition of
its buffer (one ``all_to_all_single``: (d-1)/d of the buffer sent, the same bytes) and adds the d
pieces it receives, in rank order.

Work goes in buckets of at most ``bucket_elements`` per rank, so a large model needs only one bucket of
scratch memory, and a caller may start a bucket's reduction as soon as its gradients are final.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _native_reduce_scatter(group) -> bool:
    return dist.get_backend(group) != "gloo"


def reduce_scatter_sum(flat: torch.Tensor, out: torch.Tensor, group, *, bucket_elements: int) -> None:
    """``out`` (numel P) = the sum over the group's d ranks of their ``flat[r*P:(r+1)*P]``, r this rank's
    index in ``group``; ``flat`` holds d*P elements. ``flat`` may be overwritten (scratch)."""
    d = dist.get_world_size(group)
    size = out.numel()
    if flat.numel() != d * size:
        raise ValueError(f"reduce_scatter_sum: {flat.numel()} elements do not split into {d} partitions of {size}")
    if d == 1:
        out.copy_(flat)
        return
    shards = flat.view(d, size)
    native = _native_reduce_scatter(group)
    step = max(1, min(int(bucket_elements), size))
    for start in range(0, size, step):
        length = min(step, size - start)
        # one bucket: the same [start, start+length) window of every rank's partition
        send = shards[:, start:start + length]
        send = send if send.is_contiguous() else send.contiguous()
        target = out.narrow(0, start, length)
        if native:
            dist.reduce_scatter_tensor(target, send.view(-1), group=group)
            continue
        received = torch.empty_like(send)
        dist.all_to_all_single(received.view(-1), send.view(-1), group=group)
        torch.sum(received, dim=0, out=target)
