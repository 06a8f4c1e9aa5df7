"""One hop around the context-parallel ring: send to rank r+1, receive from rank r−1 (mod C).

Both directions of a hop go into ONE ``dist.batch_isend_irecv`` call, so under NCCL they form one
group of point-to-point operations and no rank can block in a send while its peer blocks in
another send (the classic ring deadlock); under gloo the sends are asynchronous anyway. The
operations are only started here: the caller computes while the bytes move and waits afterwards.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class RingHop:
    """The ring of ``group`` (the default group when None) as seen from this rank."""

    def __init__(self, group=None):
        if not dist.is_initialized():      # a single process: a ring of one, never asked to hop
            self.group, self.size, self.rank = None, 1, 0
            return
        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        # P2POp wants global ranks; the ring is in the group's own numbering.
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def start(self, tensors: list[torch.Tensor], tag: int = 0) -> "PendingHop":
        """Send ``tensors`` (contiguous, left untouched until :meth:`PendingHop.wait`) to the next rank and
        receive same-shaped ones from the previous rank. ``tag`` keeps two hops in flight apart on gloo
        (NCCL ignores tags and matches by order, which is the same on every rank)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = []
        for i, (send, recv) in enumerate(zip(tensors, received)):
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group, tag + i))
        return PendingHop(dist.batch_isend_irecv(ops), received)


class PendingHop:
    """A hop in flight; :meth:`wait` returns what arrived from the previous rank."""

    def __init__(self, requests, received: list[torch.Tensor]):
        self._requests = requests
        self._received = received

    def wait(self) -> list[torch.Tensor]:
        for request in self._requests:
            request.wait()
        return self._received
