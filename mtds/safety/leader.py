"""One rank does long work first (build a cache, convert a checkpoint); the others wait for it through
the rendezvous store, not in a collective.

Why not a barrier or a broadcast: a collective runs under ``--dist-timeout`` (600 s by default), so any
work that takes longer -- tokenizing a corpus, converting a TB checkpoint -- killed the job. Here the
waiting ranks poll one store key (each request bounded by the store's own timeout, not the wait), say
every ``report_s`` that they are still waiting and for what, and stop with one line if the leader's work
failed. A leader that dies outright is the heartbeat's business (it names the rank).

Polling at scale: every waiting rank of the job asks the one rendezvous store, which also serves the
heartbeat. The interval starts short (short work is noticed within ~``first_s``) and doubles up to
``max(poll_s, world / STORE_RATE)`` (:func:`poll_intervals`), so the whole job's waiting ranks ask at
most ~STORE_RATE times a second once the work runs long: 1,024 ranks poll every 5.1 s, not 2,048
requests/s. ``TCPStore.wait`` would block without polling, but each timed-out wait logs two C++ warnings
per rank, and timing out is how a waiting rank gets to report.
"""
from __future__ import annotations

import itertools
import time

from mtds.safety.store import rendezvous_store

_calls = itertools.count()    # keys are per call, so a process running several runs starts fresh
FAILED = "failed:"
STORE_RATE = 200.0            # polls per second the store may get from all waiting ranks together


def poll_intervals(poll_s: float, world: int, first_s: float = 0.05):
    """Seconds between a waiting rank's polls: first_s, doubling, capped at max(poll_s, world / STORE_RATE)."""
    cap = max(poll_s, world / STORE_RATE)
    interval = min(first_s, cap)
    while True:
        yield interval
        interval = min(2 * interval, cap)


def leader_first(work, *, leader: bool, scope: str, waiting_for: str, failure: str,
                 error: type[Exception] = RuntimeError, log=print, poll_s: float = 0.5, report_s: float = 60.0,
                 rank: int | None = None, world: int | None = None):
    """``work()`` on the leader, which then publishes success or its failure; the other ranks of the same
    ``scope`` (a name every rank of the group passes alike, e.g. ``"node3"``) wait for that and return
    None, or raise ``error("<failure>: <the leader's first line>")``. Every rank calls this in the same
    order (the store key counts calls). ``world``: how many ranks may poll the store (default: the
    process group's size)."""
    key = f"mtds/leader/{next(_calls)}/{scope}"
    store = rendezvous_store(60.0)
    if leader:
        try:
            out = work()
        except BaseException as err:
            text = str(err).strip()
            store.set(key, FAILED + (text.splitlines()[0] if text else type(err).__name__))
            raise
        store.set(key, "done")
        return out
    if world is None:
        import torch.distributed as dist
        world = dist.get_world_size() if dist.is_initialized() else 1
    start = last = time.monotonic()
    intervals = poll_intervals(poll_s, world)
    while not store.check([key]):
        time.sleep(next(intervals))
        if time.monotonic() - last >= report_s:
            last = time.monotonic()
            who = "" if rank is None else f"rank {rank} "
            log(f"{who}still waiting for {waiting_for} ({last - start:.0f} s)")
    value = store.get(key).decode()
    if value.startswith(FAILED):
        raise error(f"{failure}: {value[len(FAILED):]}")
    return None


__all__ = ["leader_first", "poll_intervals", "FAILED", "STORE_RATE"]
