"""Run a check's cases on ``world`` ranks of the machine's device with a hard wall-clock bound.

Every case runs on every rank; after each, the ranks agree (one all-reduce) whether all of them got
through, and stop at the first that did not, so a failed case never leaves a peer waiting in another
case's collectives. A rank that hangs is killed at the bound (``mtds.local_ranks.spawn``): the check then
reports a timeout instead of waiting.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Outcome:
    """Per case, in order: (ok, value or one-line error) from the reporting rank; ``error`` when the ranks
    failed or timed out as a whole (then ``cases`` holds nothing)."""
    cases: list[tuple[bool, Any]]
    error: str | None
    seconds: float


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _run_cases(fn: Callable, cases: list, setup: Callable | None, reporting: int | None):
    import torch
    import torch.distributed as dist
    context = setup() if setup is not None else None
    dist.barrier()      # the peers wait here, outside any run, while rank 0 prepares (the reference)
    from mtds.training.distributed import group_device
    device = group_device()
    out = []
    for case in cases:
        try:
            value, ok = fn(case), 1
        except Exception as err:        # reported as this case's failure
            value, ok = one_line(err), 0
        flag = torch.tensor([ok], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        out.append((bool(ok), value))
        if not flag.item():
            if ok:
                out[-1] = (False, "another rank failed in this case")
            break
    rank = dist.get_rank()
    keep = reporting if reporting is not None else dist.get_world_size() - 1
    return {"cases": out if rank == keep else None, "context": context if rank == 0 else None}


def run_cases(machine, world: int, fn: Callable, cases: list, *, timeout: float, setup: Callable | None = None,
              env: dict | None = None) -> tuple[Outcome, Any]:
    """``fn(case)`` on each of ``world`` ranks for every case; ``setup()`` first on every rank (rank 0's
    value is returned as the context). Results come from the last rank (the last pipeline stage)."""
    from mtds.local_ranks.spawn import spawn
    start = time.monotonic()
    try:
        per_rank = spawn(_run_cases, world, fn, cases, setup, None, timeout=timeout, env=env, on=machine.device)
    except Exception as err:            # RankFailure: a rank raised outside a case, or the bound expired
        text = str(err).strip()
        detail = text.splitlines()[0] if text else type(err).__name__
        tail = [line for line in text.splitlines() if line.strip()][-1:] if "\n" in text else []
        return Outcome([], f"{detail}{' / ' + tail[0].strip() if tail else ''}"[:400], time.monotonic() - start), None
    return Outcome(per_rank[-1]["cases"], None, time.monotonic() - start), per_rank[0]["context"]
