"""Local rank 0 of each node builds a cache first; the node's other ranks wait for it through the
rendezvous store, then read the cache.

Not a process-group barrier: a barrier is a collective under ``--dist-timeout`` (600 s), so tokenizing a
corpus that takes longer killed the job. Here the waiting ranks poll one store key, report every
minute, and stop with the builder's failure as one line (mtds.safety.leader). One builder per node:
nodes without a shared filesystem each fill their own cache; with a shared one, the writes are atomic
(tmp + rename), so two nodes building the same cache is wasted work, never a torn file.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from mtds.safety.leader import leader_first

from mtds.data.errors import DataError


def local_rank_zero_first(build, *, what: str, log=print, poll_s: float = 0.5, report_s: float = 60.0):
    """``build()`` on local rank 0 first, then on the other ranks of its node; returns its result."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return build()
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = max(int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())), 1)
    out = leader_first(build, leader=local_rank == 0, scope=f"node{rank // local_world}",
                       waiting_for=f"local rank 0 to build {what}", failure=f"local rank 0 could not build {what}",
                       error=DataError, rank=rank,
                       log=lambda line: log(f"data: {line}"), poll_s=poll_s, report_s=report_s)
    return out if local_rank == 0 else build()
