"""A client connection of this rank's own to the rendezvous store (MASTER_ADDR:MASTER_PORT), for work
beside the process group: the heartbeat, ranks waiting for a builder. Its own connection, so a main
thread busy in the store cannot block it; each request is bounded by ``timeout_s``.

Under torchrun the store is the agent's, and it outlives the workers: after a restart the new workers meet
the keys the old ones left (gloo's addresses of dead processes, an old heartbeat alarm, a leader's "done").
Every key of a run is therefore under the restart's own prefix (:func:`attempt_prefix`), the process
group's as well (mtds.training.distributed)."""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def attempt_prefix() -> str:
    """``mtds/attempt<N>/`` under torchrun (N: TORCHELASTIC_RESTART_COUNT), "" elsewhere."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"mtds/attempt{count}/" if count is not None else ""


def rendezvous_store(timeout_s: float) -> dist.Store:
    """A client of the rendezvous store, under this attempt's prefix."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    prefix = attempt_prefix()
    return dist.PrefixStore(prefix, store) if prefix else store

