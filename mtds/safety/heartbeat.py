"""A watchdog where torch has none: notice a rank that is dead or frozen even when no socket says so.

A killed process closes its sockets and the peers' gloo calls fail at once; a frozen process (SIGSTOP,
a swapped-out or wedged host) or a host that vanished without closing its connections does not, and
the peers would wait in their collectives for the full ``--dist-timeout``. Here every rank bumps a
counter in the rendezvous store (its own client connection, so a main thread busy in the store cannot
block it) every ``interval_s`` and watches the others' counters; one that has not moved for
``timeout_s`` ends this process with one ``error:`` line naming that rank and exit code 1.
A rank that leaves ``run()`` normally writes "done", which is never mistaken for silence. One that leaves
it with an error writes "failed:<error type>": its process may live on (a caller that catches the error)
and keep its sockets open, so the peers would wait in a collective it will never join; they stop
``FAILED_GRACE_S`` after seeing it (time for their own copy of an error raised on every rank to win).
"""
from __future__ import annotations

import datetime
import itertools
import os
import sys
import threading
import time

import torch.distributed as dist


FAILED = "failed:"
FAILED_GRACE_S = 5.0


class Heartbeat:
    _runs = itertools.count()        # keys are per run(), so a process running several runs starts fresh

    def __init__(self, timeout_s: float, interval_s: float | None = None):
        self.timeout_s = timeout_s
        self.interval_s = interval_s or max(0.5, min(3.0, timeout_s / 5))
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None
        self._prefix = ""

    def start(self) -> "Heartbeat":
        if self.timeout_s <= 0 or not dist.is_initialized() or dist.get_world_size() == 1:
            return self
        rank, world = dist.get_rank(), dist.get_world_size()
        self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=datetime.timedelta(seconds=max(self.timeout_s, 10)))
        self._prefix = f"mtds/heartbeat/{next(self._runs)}/"
        self._store.set(self._prefix + str(rank), "0")
        self._thread = threading.Thread(target=self._beat, args=(rank, world), daemon=True, name="mtds-heartbeat")
        self._thread.start()
        return self

    def _beat(self, rank: int, world: int) -> None:
        keys = [self._prefix + str(r) for r in range(world)]
        last: dict[int, tuple[str, float]] = {}
        count = 0
        try:
            while not self._done.wait(self.interval_s):
                count += 1
                self._store.set(keys[rank], str(count))
                now = time.monotonic()
                present = self._store.check(keys)   # every rank has started beating
                values = self._store.multi_get(keys) if present else []
                for r, value in enumerate(values):
                    value = value.decode()
                    if r == rank or value == "done":
                        continue
                    if last.get(r, ("", 0.0))[0] != value:
                        last[r] = (value, now)
                    elif value.startswith(FAILED):
                        if now - last[r][1] >= min(FAILED_GRACE_S, self.timeout_s) and not self._done.is_set():
                            self._fail(f"rank {r} left training with an error ({value[len(FAILED):]}; see its "
                                       f"output); rank {rank} stops instead of waiting for it in a collective: "
                                       f"fix that error, then restart from the last complete checkpoint (--load)")
                    elif now - last[r][1] >= self.timeout_s and not self._done.is_set():
                        self._fail(f"rank {r} has not been heard from for {now - last[r][1]:.0f} s (dead or frozen); "
                                   f"rank {rank} stops instead of waiting for --dist-timeout: restart from the "
                                   f"last complete checkpoint (--load)")
        except Exception as err:           # the store itself went away: rank 0's host is gone
            if not self._done.is_set():
                self._fail(f"lost the rendezvous store ({type(err).__name__}): rank 0 is dead or unreachable; "
                           f"restart from the last complete checkpoint (--load)")

    @staticmethod
    def _fail(message: str) -> None:
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    def stop(self, error: BaseException | None = None) -> None:
        """Stop beating; tell the peers whether this rank finished ("done") or failed with ``error``."""
        if self._thread is None:
            return
        self._done.set()
        self._thread.join(timeout=10)
        self._thread = None
        try:
            self._store.set(self._prefix + str(dist.get_rank()),
                            "done" if error is None else FAILED + type(error).__name__)
        except Exception:       # the store may already be gone at shutdown
            pass
