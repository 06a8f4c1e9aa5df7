"""Run a function on N real ranks (gloo on CPU, NCCL with one GPU per rank) with a hard timeout.

Used by the test-suite and by benchmarks. A rank that raises reports its traceback; a rank that
hangs is killed when the timeout expires; either way the caller gets one ``RankFailure`` naming the
rank, never a hung suite.

Where the body runs: on a live :class:`~mtds.testing.pool.RankPool` of that world size when pools are
on (``tests/conftest.py`` turns them on for a pytest session, :func:`use_pools`), else -- and always with
``fresh=True`` -- on new processes started for this one call (forked from a forkserver that has the
heavy imports done, writing to the caller's stdout/stderr; benchmarks use these). Fresh workers leave with ``os._exit`` after
flushing, which avoids the random "terminate called without an active exception" abort that gloo
ranks suffer at interpreter exit.

Device: ``cpu`` (gloo; CUDA is hidden from the ranks so training cannot pick it) or ``cuda`` (NCCL,
rank r on GPU r; a world larger than the GPUs present is skipped when run under pytest).
"""
from __future__ import annotations

import os
import pickle
import queue
import sys
import time
import traceback
from typing import Any, Callable

from mtds.testing.rank_setup import (PORT_IN_USE, PRELOAD, RankFailure, free_port, join_group, leave,
                                     rank_environment, start_context)

__all__ = ["spawn", "use_pools", "close_pools", "pool_stats", "device", "RankFailure", "free_port", "PRELOAD",
           "PORT_IN_USE", "rank_environment", "start_context", "join_group", "leave"]

DEVICES = ("cpu", "cuda")
fresh_ranks_started = 0               # ranks started by fresh spawns in this process (for the suite's summary)
_pools: dict[int, Any] = {}
_pool_device: str | None = None       # None: pools off


def use_pools(device: str = "cpu") -> None:
    """From now on, :func:`spawn` runs bodies on live pools (one per world size), on ``device``."""
    global _pool_device
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    _pool_device = device


def close_pools() -> None:
    """Stop every pool (:func:`pool_stats` tells what they did)."""
    global _pool_device
    for pool in _pools.values():
        pool.close()
        pool.remove_logs()     # a failure already carried their tails
    _pools.clear()
    _pool_device = None


def pool_stats() -> dict[int, tuple[int, int]]:
    """{world size: (bodies run, starts)}; starts count the first, restarts after a failure and recycles."""
    return {world: (pool.bodies, pool.starts) for world, pool in sorted(_pools.items())}


def device() -> str:
    return _pool_device or os.environ.get("MTDS_TEST_DEVICE", "cpu")


PORT_ATTEMPTS = 3              # rendezvous ports tried before a port clash counts as a failure


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
          env: dict[str, str] | None = None, fresh: bool = False, on: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``fresh``: new processes for this call even when pools are on (bodies that kill or signal their
    own process, or whose test reads the ranks' stderr).
    ``on``: the device ("cpu" or "cuda") for tools that choose it themselves (``mtds.gpucheck``); None:
    the suite's (:func:`device`). A pool runs the body only when it is on that device.
    """
    if not 1 <= world_size <= 64:
        raise ValueError(f"world_size must be in 1..64, got {world_size}")
    if on is not None and on not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {on!r}")
    dev = on or device()
    if dev == "cuda" and on is None:
        _skip_without_gpus(world_size)
    if _pool_device is not None and _pool_device == dev and not fresh:
        from mtds.testing.pool import RankPool
        pool = _pools.get(world_size)
        if pool is None:
            pool = _pools[world_size] = RankPool(world_size, _pool_device)
        return pool.run(fn, args, timeout, env)
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _spawn_once(fn, world_size, args, timeout, env, free_port(), dev)
        except RankFailure as failure:
            # free_port() releases the port before rank 0 binds it; another process can take it in
            # between. Rank 0 then fails in rendezvous, before `fn` ran anywhere: try a new port.
            if PORT_IN_USE not in str(failure) or attempt == PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def needs_ranks(world: int) -> None:
    """For tests that start ``world`` ranks through a launcher (deepspeed, torchrun) rather than
    :func:`spawn`: under ``MTDS_TEST_DEVICE=cuda`` each rank needs its own GPU, so skip with the reason
    where fewer are present; on CPU (gloo) any number of ranks runs."""
    if device() == "cuda":
        _skip_without_gpus(world)


def _skip_without_gpus(world: int) -> None:
    import torch
    have = torch.cuda.device_count()
    if world > have:
        import pytest
        pytest.skip(f"needs {world} GPUs (one rank per GPU), {have} present")


class _CallersFd:
    """The caller's fd ``fd`` (1 or 2) for a forkserver child, which otherwise writes to the forkserver's:
    tests that read the ranks' stderr (pytest's capfd) see it as with the ``spawn`` start method."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, timeout_s: float,
            env: dict[str, str], dev: str, out_fds: tuple[int, int] | None = None) -> None:
    code = 0
    if out_fds is not None:
        os.dup2(out_fds[0], 1)
        os.dup2(out_fds[1], 2)
    try:
        join_group(rank, world_size, port, dev, timeout_s, env)
        import torch.distributed as dist
        # Plain pickle: tensors travel as bytes, not as shared memory that dies with this process.
        value = pickle.dumps(fn(*args))
        results.put((rank, True, value))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))
        code = 1
    finally:
        leave(results, code)


def _spawn_once(fn: Callable, world_size: int, args: tuple, timeout: float, env: dict[str, str] | None,
                port: int, dev: str) -> list[Any]:
    ctx = start_context(dev)
    results = ctx.Queue()
    sys.stdout.flush()
    sys.stderr.flush()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, port, fn, args, results, timeout, dict(env or {}), dev,
                               (_CallersFd(1), _CallersFd(2)))) for r in range(world_size)]
    global fresh_ranks_started
    for p in procs:
        p.start()
    fresh_ranks_started += len(procs)

    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}  # in arrival order: the first is usually the cause, later ones collateral
    try:
        while len(values) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                # A rank killed by a signal never reports: notice it instead of waiting out the timeout.
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in values and r not in failures:
                        failures[r] = f"exited with code {p.exitcode} before reporting"
                if failures:
                    break
                continue
            (values if ok else failures)[rank] = value
    finally:
        if failures or len(values) < world_size:
            for p in procs:
                if p.is_alive():
                    p.kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    if failures:
        first = next(iter(failures))
        detail = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        raise RankFailure(f"rank {first} failed ({len(failures)} of {world_size} ranks)\n{detail}")
    missing = [r for r in range(world_size) if r not in values]
    if missing:
        raise RankFailure(f"ranks {missing} did not finish within {timeout:.0f} s (hang or deadlock)")
    return [pickle.loads(values[r]) for r in range(world_size)]
