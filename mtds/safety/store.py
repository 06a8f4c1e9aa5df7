"""A client connection of this rank's own to the rendezvous store (MASTER_ADDR:MASTER_PORT), for work
beside the process group: the heartbeat, ranks waiting for a builder. Its own connection, so a main
thread busy in the store cannot block it; each request is bounded by ``timeout_s``."""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def rendezvous_store(timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
