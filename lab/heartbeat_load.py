"""Requests the heartbeat puts on the rendezvous store, measured: N heartbeats (threads, each with its own
real ``TCPStore`` client) beat against one store; every request is counted on the client side.

Formulas (per beat): watching every rank costs each rank one ``multi_get`` of N keys, N² key reads on
rank 0's store in all; the ring watch costs each rank 1 set, 1 alarm check, ~2 neighbour checks and one
``multi_get`` of 2 keys: ~4N key requests, independent of N per rank.
"""
from __future__ import annotations

import datetime
import threading
import time
from collections import Counter

import torch.distributed as dist

from mtds.safety.heartbeat import Heartbeat


class CountingStore:
    """A store client that counts requests and keys read (a ``multi_get`` of k keys reads k)."""

    def __init__(self, store):
        self.store, self.requests, self.keys_read = store, Counter(), 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args):
            self.requests[name] += 1
            if name in ("get", "compare_set"):
                self.keys_read += 1
            elif name in ("multi_get", "check"):
                self.keys_read += len(args[0])
            return method(*args)
        return counted


def measure(world: int, beats: int = 3, port: int = 0) -> dict:
    """``beats`` rounds of ``world`` heartbeats on one fresh store: requests and keys read per rank per
    beat, and the wall time of a round."""
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    clients = [CountingStore(dist.TCPStore("127.0.0.1", master.port, is_master=False,
                                           timeout=datetime.timedelta(seconds=60))) for _ in range(world)]
    beats_ = [Heartbeat(timeout_s=60.0) for _ in range(world)]
    for rank, (hb, client) in enumerate(zip(beats_, clients)):
        hb.attach(client, "bench/", rank, world)
    for client in clients:
        client.requests.clear()
        client.keys_read = 0
    start = time.perf_counter()
    for b in range(beats):
        threads = [threading.Thread(target=hb.beat_once, args=(float(b),)) for hb in beats_]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elapsed = time.perf_counter() - start
    requests = sum(sum(c.requests.values()) for c in clients)
    keys = sum(c.keys_read for c in clients)
    return {"world": world, "requests_per_rank_per_beat": requests / world / beats,
            "keys_read_per_rank_per_beat": keys / world / beats, "store_keys_read_per_beat": keys / beats,
            "all_ranks_formula_keys_per_beat": world * world, "round_s": elapsed / beats}
