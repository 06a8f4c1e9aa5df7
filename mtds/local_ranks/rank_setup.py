"""What a process needs to become one rank of a test world, shared by fresh ranks (lab.testing.ranks) and
pooled ones (lab.testing.pool): a free port, the rank's environment, how processes start, joining
the default group and leaving.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys

import torch.multiprocessing as mp

PORT_IN_USE = "EADDRINUSE"


class RankFailure(RuntimeError):
    """One or more ranks failed or timed out; the message carries their tracebacks."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world: int, port: int, device: str) -> dict[str, str]:
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""     # gloo ranks: training must not pick a GPU it can see
    return env


# Imported once in the forkserver, so every rank it forks starts with them (the test pools add the rest
# of mtds: preload_also).
PRELOAD = ["torch", "torch.distributed", "deepspeed", "deepspeed.runtime.pipe.engine", "transformers",
           "mtds.training"]
_also_preload: list[str] = []


def preload_also(modules: list[str]) -> None:
    """More modules for the forkserver to import (the test pools': every mtds module, so that no pooled
    rank imports them itself), from its next start on; ``[]`` for :data:`PRELOAD` alone."""
    _also_preload[:] = modules


def start_context(dev: str):
    """How ranks start. CPU: forked from a forkserver with :data:`PRELOAD` imported (a new rank costs a
    fork, not seconds of imports). CUDA: ``spawn`` -- importing DeepSpeed asks torch for the device count,
    which initialises the CUDA driver, and a CUDA-initialised process must not fork."""
    if dev == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD + _also_preload)
    _start_forkserver_without_gpus()
    return ctx


def _start_forkserver_without_gpus() -> None:
    """Start the forkserver with every GPU hidden. Its PRELOAD imports DeepSpeed, which asks torch for the
    device count: where a GPU is visible (``python -m mtds.gpucheck --device cpu`` on a GPU machine) the
    forkserver would initialise CUDA, and its forked CPU ranks -- CUDA_VISIBLE_DEVICES= set only once they
    run -- would fail "No CUDA GPUs are available" (seen on an H100, 2026-11-24). Ranks inherit the
    forkserver's environment, so they start with the GPUs hidden too. A forkserver already running is kept."""
    from multiprocessing import forkserver
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def join_group(rank: int, world: int, port: int, dev: str, timeout_s: float, env: dict[str, str] | None = None,
               threads: int | None = None):
    """This process becomes rank ``rank``: its environment, its BLAS threads (``threads``, else
    OMP_NUM_THREADS or 1), its GPU, the default group."""
    os.environ.update(rank_environment(rank, world, port, dev))
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)     # mtds.training reads it when it sets up gloo
    os.environ.update(env or {})
    import torch
    import torch.distributed as dist
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if dev == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if dev == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def leave(results, code: int) -> None:
    """Exit a rank: the queue's feeder thread must deliver before ``os._exit`` or the parent never hears
    from us; ``os._exit`` itself avoids gloo's random abort at interpreter exit."""
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
