"""Run a function on N local ranks (gloo on CPU, NCCL with one GPU per rank) with a hard timeout.

A rank that raises reports its traceback; a rank that hangs is killed when the timeout expires; either
way the caller gets one ``RankFailure`` naming the rank, never a hang. The ranks are new processes started
for the call, forked from a forkserver that has the heavy imports done, writing to the caller's
stdout/stderr. They leave with ``os._exit`` after flushing, which avoids the random "terminate called
without an active exception" abort that gloo ranks suffer at interpreter exit.

A runner of live ranks (the test-suite's pool, outside the package) may be installed with
:func:`set_pool_runner`; :func:`spawn` hands it each call not marked ``fresh``.

Device: ``cpu`` (gloo; CUDA is hidden from the ranks so training cannot pick it) or ``cuda`` (NCCL,
rank r on GPU r).
"""
from __future__ import annotations

import os
import pickle
import queue
import sys
import time
import traceback
from typing import Any, Callable

from mtds.local_ranks.rank_setup import PORT_IN_USE, RankFailure, free_port, join_group, leave, start_context

__all__ = ["spawn", "set_pool_runner", "RankFailure", "free_port", "DEVICES"]

DEVICES = ("cpu", "cuda")
PORT_ATTEMPTS = 3              # rendezvous ports tried before a port clash counts as a failure
fresh_ranks_started = 0        # ranks started by fresh spawns in this process (the suite's summary reads it)
_pool_runner: Callable | None = None


def set_pool_runner(runner: Callable | None) -> None:
    """Install (or, with None, remove) ``runner(fn, world_size, args, timeout, env, device)``: it returns the
    per-rank results, or ``NotImplemented`` to let :func:`spawn` start fresh ranks instead."""
    global _pool_runner
    _pool_runner = runner


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
          env: dict[str, str] | None = None, fresh: bool = False, on: str = "cpu") -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks on device ``on``; return the per-rank results in rank order.

    ``fresh``: new processes for this call even when a pool runner is installed (bodies that kill or
    signal their own process, or whose caller reads the ranks' stderr)."""
    if not 1 <= world_size <= 64:
        raise ValueError(f"world_size must be in 1..64, got {world_size}")
    if on not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {on!r}")
    if _pool_runner is not None and not fresh:
        out = _pool_runner(fn, world_size, args, timeout, env, on)
        if out is not NotImplemented:
            return out
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _spawn_once(fn, world_size, args, timeout, env, free_port(), on)
        except RankFailure as failure:
            # free_port() releases the port before rank 0 binds it; another process can take it in
            # between. Rank 0 then fails in rendezvous, before `fn` ran anywhere: try a new port.
            if PORT_IN_USE not in str(failure) or attempt == PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


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
