"""A watchdog where torch has none: notice a rank that is dead or frozen even when no socket says so.

A killed process closes its sockets and the peers' gloo calls fail at once; a frozen process (SIGSTOP,
a swapped-out or wedged host) or a host that vanished without closing its connections does not, and
the peers would wait in their collectives for the full ``--dist-timeout``. Here every rank bumps a
counter in the rendezvous store (its own client connection, so a main thread busy in the store cannot
block it) every ``interval_s`` and watches its two ring neighbours' counters; one that has not moved for
``timeout_s`` raises an alarm in the store, and every rank ends with the same ``error:`` line naming
that rank and exit code 1.
A rank that leaves ``run()`` normally writes "done", which is never mistaken for silence. One that leaves
it with an error writes "failed:<error type>": its process may live on (a caller that catches the error)
and keep its sockets open, so the peers would wait in a collective it will never join; they stop
``FAILED_GRACE_S`` after seeing it (time for their own copy of an error raised on every rank to win).
"""
from __future__ import annotations

import itertools
import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

from mtds.safety.restarts import restart_note
from mtds.safety.store import rendezvous_store


FAILED = "failed:"
FAILED_GRACE_S = 5.0


ALARM = "alarm"


class Heartbeat:
    """Each rank bumps its own counter and watches only its two ring neighbours (the nearest rank on each
    side that has not finished), so the rendezvous store serves about 4 requests per rank per beat
    whatever the world size (watching every rank cost N reads per rank per beat: N² on rank 0's store,
    ~260,000 per beat at 512 ranks). A rank that sees a neighbour die or fail posts the message under
    one alarm key, which every rank reads each beat: all ranks stop with the same line within about a
    beat of the detection."""

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
        self.attach(rendezvous_store(max(self.timeout_s, 10)), f"mtds/heartbeat/{next(self._runs)}/", rank, world)
        self._thread = threading.Thread(target=self._beat, daemon=True, name="mtds-heartbeat")
        self._thread.start()
        return self

    def attach(self, store, prefix: str, rank: int, world: int) -> None:
        """Use ``store`` (its own client connection) under ``prefix`` as ``rank`` of ``world``."""
        self._store, self._prefix, self.rank, self.world = store, prefix, rank, world
        self._count, self._last = 0, {}          # watched rank -> (value, when it last changed)
        self._started: set[int] = set()          # ranks whose key exists (checked once)
        self._store.set(self._key(rank), "0")
        self._store.set(self._prefix + f"pid/{rank}", f"{socket.gethostname()}:{os.getpid()}")

    def _key(self, rank) -> str:
        return self._prefix + str(rank)

    def _watched(self) -> list[tuple[int, str]]:
        """(rank, value) of the nearest rank on each side of the ring that has not said "done" (fewer at
        the end of a run); [] until they have started beating. Normally one ``multi_get`` of two keys."""
        fronts = {step: (self.rank + step) % self.world for step in (1, -1)}
        watched: dict[int, str] = {}
        while fronts:
            ranks = sorted(set(fronts.values()))
            new = [r for r in ranks if r not in self._started]
            if new:
                if not self._store.check([self._key(r) for r in new]):
                    return []
                self._started.update(new)
            values = dict(zip(ranks, (v.decode() for v in self._store.multi_get([self._key(r) for r in ranks]))))
            for step, r in list(fronts.items()):
                if values[r] != "done":
                    watched[r] = values[r]
                    del fronts[step]
                elif (r + step) % self.world == self.rank:
                    del fronts[step]
                else:
                    fronts[step] = (r + step) % self.world
        return list(watched.items())

    def beat_once(self, now: float) -> str | None:
        """One beat: bump this rank's counter, read the alarm and the neighbours; the message this rank
        must stop with, or None."""
        self._count += 1
        self._store.set(self._key(self.rank), str(self._count))
        alarm = self._prefix + ALARM
        if self._store.check([alarm]):
            return self._store.get(alarm).decode()
        for r, value in self._watched():
            if self._last.get(r, ("", 0.0))[0] != value:
                self._last[r] = (value, now)
            elif value.startswith(FAILED):
                if now - self._last[r][1] >= min(FAILED_GRACE_S, self.timeout_s):
                    return self._raise_alarm(
                        f"rank {r} left training with an error ({value[len(FAILED):]}; see its output); the other "
                        f"ranks stop instead of waiting for it in a collective: fix that error, then restart from "
                        f"the last complete checkpoint (--load)")
            elif now - self._last[r][1] >= self.timeout_s:
                message = self._raise_alarm(
                    f"rank {r} has not been heard from for {now - self._last[r][1]:.0f} s (dead or frozen; noticed "
                    f"by rank {self.rank}); the other ranks stop instead of waiting for --dist-timeout: "
                    f"{restart_note()}")
                self._end_frozen(r)
                return message
        return None

    def _end_frozen(self, rank: int) -> None:
        """Under torchrun, SIGKILL a silent rank of this host: its agent would send a frozen (SIGSTOPped)
        process SIGTERM, which it never handles, and SIGKILL only 30 s later -- the restart waits for that. A
        rank on another host is left to its own agent."""
        if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
            return
        key = self._prefix + f"pid/{rank}"
        try:
            if not self._store.check([key]):
                return
            host, pid = self._store.get(key).decode().rsplit(":", 1)
            if host == socket.gethostname():
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):       # gone already, or not ours to signal
            pass

    def _raise_alarm(self, message: str) -> str:
        # The first alarm wins (compare_set on an absent key): every rank then stops with the same line.
        alarm = self._prefix + ALARM
        return self._store.compare_set(alarm, "", message).decode()

    def _beat(self) -> None:
        try:
            while not self._done.wait(self.interval_s):
                message = self.beat_once(time.monotonic())
                if message is not None and not self._done.is_set():
                    self._fail(message)
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
