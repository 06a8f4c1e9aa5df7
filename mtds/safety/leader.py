"""One rank does long work first (build a cache, convert a checkpoint); the others wait for it through
the rendezvous store, not in a collective.

Why not a barrier or a broadcast: a collective runs under ``--dist-timeout`` (600 s by default), so any
work that takes longer -- tokenizing a corpus, converting a TB checkpoint -- killed the job. Here the
waiting ranks poll one store key (one small request every ``poll_s``: O(waiting ranks) requests per
interval, each bounded by the store's own timeout, not the wait), say every ``report_s`` that they are
still waiting and for what, and stop with one line if the leader's work failed. A leader that dies
outright is the heartbeat's business (it names the rank).
"""
from __future__ import annotations

import itertools
import time

from .store import rendezvous_store

_calls = itertools.count()    # keys are per call, so a process running several runs starts fresh
FAILED = "failed:"


def leader_first(work, *, leader: bool, scope: str, waiting_for: str, failure: str,
                 error: type[Exception] = RuntimeError, log=print, poll_s: float = 0.5, report_s: float = 60.0,
                 rank: int | None = None):
    """``work()`` on the leader, which then publishes success or its failure; the other ranks of the same
    ``scope`` (a name every rank of the group passes alike, e.g. ``"node3"``) wait for that and return
    None, or raise ``error("<failure>: <the leader's first line>")``. Every rank calls this in the same
    order (the store key counts calls)."""
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
    start = last = time.monotonic()
    while not store.check([key]):
        time.sleep(poll_s)
        if time.monotonic() - last >= report_s:
            last = time.monotonic()
            who = "" if rank is None else f"rank {rank} "
            log(f"{who}still waiting for {waiting_for} ({last - start:.0f} s)")
    value = store.get(key).decode()
    if value.startswith(FAILED):
        raise error(f"{failure}: {value[len(FAILED):]}")
    return None


__all__ = ["leader_first", "FAILED"]
