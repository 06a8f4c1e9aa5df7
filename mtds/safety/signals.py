"""SIGTERM / SIGINT (what a scheduler sends before preemption) as a request to stop cleanly.

The handler only records the signal; after each step the training loop agrees on it over every rank in
one all-reduce (with the non-finite flags, ``mtds.training.hooks.NonFiniteHook``; :meth:`StopRequest.agreed`
alone elsewhere), so all ranks stop after the same step even when the signal
reached them at different times (or reached only one). A second signal is not deferred: SIGINT
raises KeyboardInterrupt, SIGTERM exits at once with 128 + 15.
"""
from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist


class StopRequest:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.received is not None:          # asked twice: the user means now
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            sys.stderr.flush()
            os._exit(128 + signum)
        self.received = signum
        print(f"mtds: received {signal.Signals(signum).name} on rank {dist.get_rank() if dist.is_initialized() else 0}"
              f": finishing the current step", file=sys.stderr, flush=True)

    def install(self) -> "StopRequest":
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:                 # not the main thread (e.g. an embedding app): no handler
                pass
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @staticmethod
    def name(signum: int) -> str | None:
        """The name of an agreed signal number (0: None)."""
        return signal.Signals(signum).name if signum else None

    def agreed(self, device) -> str | None:
        """Name of the signal if any rank received one (same answer on every rank), else None."""
        local = torch.tensor([self.received or 0], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return signal.Signals(int(local.item())).name if int(local.item()) else None
