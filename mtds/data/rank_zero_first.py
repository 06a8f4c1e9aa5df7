"""Local rank 0 of each node builds a cache first; the node's other ranks wait for it through the
rendezvous store, then read the cache.

Not a process-group barrier: a barrier is a collective under ``--dist-timeout`` (600 s), so tokenizing a
corpus that takes longer killed the job. Here the waiting ranks poll one store key (a request every
``poll_s``; the store's own timeout bounds each request, not the wait), say every minute that they are
still waiting and for what, and stop with one line if the builder failed. A builder that dies outright is
the heartbeat's business (it names the rank). One builder per node: nodes without a shared filesystem
each fill their own cache; with a shared one, the writes are atomic (tmp + rename), so two nodes
building the same cache is wasted work, never a torn file.
"""
from __future__ import annotations

import itertools
import os
import time

import torch.distributed as dist

from mtds.safety.store import rendezvous_store

from .errors import DataError

_runs = itertools.count()     # keys are per call, so a process running several runs starts fresh
FAILED = "failed:"


def local_rank_zero_first(build, *, what: str, log=print, poll_s: float = 0.5, report_s: float = 60.0):
    """``build()`` on local rank 0 first, then on the other ranks of its node; returns its result."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return build()
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = max(int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())), 1)
    key = f"mtds/data/{next(_runs)}/node{rank // local_world}"
    store = rendezvous_store(60.0)
    if local_rank == 0:
        try:
            out = build()
        except BaseException as err:
            text = str(err).strip()
            store.set(key, FAILED + (text.splitlines()[0] if text else type(err).__name__))
            raise
        store.set(key, "done")
        return out
    start = last = time.monotonic()
    while not store.check([key]):
        time.sleep(poll_s)
        if time.monotonic() - last >= report_s:
            last = time.monotonic()
            log(f"data: rank {rank} still waiting for local rank 0 to build {what} ({last - start:.0f} s)")
    value = store.get(key).decode()
    if value.startswith(FAILED):
        raise DataError(f"local rank 0 could not build {what}: {value[len(FAILED):]}")
    return build()
