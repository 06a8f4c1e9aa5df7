"""Run a function on N real ranks (spawned processes, gloo) with a hard timeout.

Used by the test-suite and by benchmarks. A rank that raises reports its traceback; a rank that
hangs is killed when the timeout expires; either way the caller gets one ``RankFailure`` naming the
rank, never a hung suite. Workers leave with ``os._exit`` after flushing, which avoids the random
"terminate called without an active exception" abort that gloo ranks suffer at interpreter exit.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """One or more ranks failed or timed out; the message carries their tracebacks."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, timeout_s: float,
            env: dict[str, str]) -> None:
    code = 0
    try:
        os.environ.update(env)
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # Plain pickle: tensors travel as bytes, not as shared memory that dies with this process.
        value = pickle.dumps(fn(*args))
        results.put((rank, True, value))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))
        code = 1
    finally:
        # The queue's feeder thread must deliver before os._exit, or the parent never hears from us.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


PORT_ATTEMPTS = 3              # rendezvous ports tried before a port clash counts as a failure
PORT_IN_USE = "EADDRINUSE"


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
          env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return the per-rank results in rank order."""
    if not 1 <= world_size <= 64:
        raise ValueError(f"world_size must be in 1..64, got {world_size}")
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _spawn_once(fn, world_size, args, timeout, env, free_port())
        except RankFailure as failure:
            # free_port() releases the port before rank 0 binds it; another process can take it in
            # between. Rank 0 then fails in rendezvous, before `fn` ran anywhere: try a new port.
            if PORT_IN_USE not in str(failure) or attempt == PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _spawn_once(fn: Callable, world_size: int, args: tuple, timeout: float, env: dict[str, str] | None,
                port: int) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, timeout, child_env),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()

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
