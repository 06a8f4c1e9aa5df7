"""The suite's entry point for multi-rank bodies: :func:`spawn` on a live pool of ranks when pools are on
(``tests/conftest.py`` turns them on for a pytest session, :func:`use_pools`), else -- and always with
``fresh=True`` -- on new processes (:func:`mtds.local_ranks.spawn.spawn`, which benchmarks use too).

Device: the suite's (``MTDS_TEST_DEVICE``, default ``cpu``); under ``cuda`` a world larger than the GPUs
present is skipped.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from mtds.local_ranks import rank_setup
from mtds.local_ranks import spawn as local_ranks
from mtds.local_ranks.rank_setup import RankFailure, free_port
from mtds.local_ranks.spawn import DEVICES

__all__ = ["spawn", "use_pools", "close_pools", "pool_stats", "device", "RankFailure", "free_port",
           "needs_ranks", "fresh_ranks_started"]

_pools: dict[int, Any] = {}
_pool_device: str | None = None       # None: pools off


def _run_on_pool(fn: Callable, world_size: int, args: tuple, timeout: float, env, dev: str):
    if _pool_device is None or _pool_device != dev:
        return NotImplemented
    from lab.testing.pool import RankPool
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = RankPool(world_size, _pool_device)
    return pool.run(fn, args, timeout, env)


def use_pools(device: str = "cpu") -> None:
    """From now on, :func:`spawn` (and ``mtds.local_ranks.spawn`` from tools such as gpucheck) runs bodies on
    live pools (one per world size), on ``device``."""
    global _pool_device
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    _pool_device = device
    local_ranks.set_pool_runner(_run_on_pool)
    # Each pooled rank imports every mtds module before its reset state is taken (~2 s a rank on two
    # cores, at every start and restart of a pool): done once in the forkserver instead.
    rank_setup.preload_also(["lab.testing.preload"])


def close_pools() -> None:
    """Stop every pool (:func:`pool_stats` tells what they did)."""
    global _pool_device
    for pool in _pools.values():
        pool.close()
        pool.remove_logs()     # a failure already carried their tails
    _pools.clear()
    _pool_device = None
    local_ranks.set_pool_runner(None)
    rank_setup.preload_also([])


def pool_stats() -> dict[int, tuple[int, int]]:
    """{world size: (bodies run, starts)}; starts count the first, restarts after a failure and recycles."""
    return {world: (pool.bodies, pool.starts) for world, pool in sorted(_pools.items())}


def fresh_ranks_started() -> int:
    """Ranks started by fresh spawns in this process."""
    return local_ranks.fresh_ranks_started


def device() -> str:
    return _pool_device or os.environ.get("MTDS_TEST_DEVICE", "cpu")


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
          env: dict[str, str] | None = None, fresh: bool = False, on: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``fresh``: new processes for this call even when pools are on (bodies that kill or signal their
    own process, or whose test reads the ranks' stderr).
    ``on``: the device ("cpu" or "cuda") for tools that choose it themselves; None: the suite's
    (:func:`device`). A pool runs the body only when it is on that device.
    """
    dev = on or device()
    if dev == "cuda" and on is None:
        _skip_without_gpus(world_size)
    return local_ranks.spawn(fn, world_size, *args, timeout=timeout, env=env, fresh=fresh, on=dev)


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
