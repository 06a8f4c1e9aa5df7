"""Run a check's cases on ``world`` ranks of the machine's device with a hard wall-clock bound.

Every case runs on every rank; after each, the ranks agree (one all-reduce) whether all of them got
through, and stop at the first that did not, so a failed case never leaves a peer waiting in another
case's collectives. A rank that hangs is killed at the bound (``mtds.local_ranks.spawn``): the check then
reports a timeout instead of waiting.

A rank whose case raises while its peers sit in that case's collectives never meets them at the
all-reduce: they wait (NCCL) or abort on the mismatched collective (gloo), and the parent sees only a
timeout or a peer's collateral error. So before meeting them the failing rank writes its one-line error to
a file of its own in a directory the parent made; the parent names that rank and error first.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
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


ANOTHER_RANK = "another rank failed in this case"


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _note_failure(errors_dir: str, case: str, error: str) -> None:
    """This rank's error, on disk before it meets its peers (who may never come): written whole or not at all."""
    import torch.distributed as dist
    rank = dist.get_rank()
    path = os.path.join(errors_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": rank, "case": case, "error": error, "time": time.time()}, f)
    os.replace(path + ".tmp", path)


def rank_errors(errors_dir: str) -> list[dict]:
    """The errors the ranks noted (:func:`_note_failure`), the earliest first: the cause, the rest collateral."""
    found = []
    for name in sorted(os.listdir(errors_dir)):
        if name.endswith(".json"):
            with open(os.path.join(errors_dir, name)) as f:
                found.append(json.load(f))
    return sorted(found, key=lambda e: e["time"])


def blamed(errors: list[dict], what: str) -> str:
    """``rank R: <error> (in <case>); ...: <what>`` naming the earliest failure first, or ``what`` alone."""
    if not errors:
        return what
    first = errors[0]
    others = "".join(f"; rank {e['rank']} also failed: {e['error']}" for e in errors[1:])
    return (f"rank {first['rank']}: {first['error']} (in {first['case']}){others}; the other ranks were blocked "
            f"in that case's collectives: {what}")


def _run_cases(fn: Callable, cases: list, setup: Callable | None, reporting: int | None, errors_dir: str):
    import torch
    import torch.distributed as dist
    context = setup() if setup is not None else None
    dist.barrier()      # the peers wait here, outside any run, while rank 0 prepares (the reference)
    from mtds.training.distributed import group_device
    device = group_device()
    out = []
    for i, case in enumerate(cases):
        try:
            value, ok = fn(case), 1
        except Exception as err:        # reported as this case's failure
            value, ok = one_line(err), 0
            _note_failure(errors_dir, getattr(case, "name", f"case {i + 1}"), value)
        flag = torch.tensor([ok], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        out.append((bool(ok), value))
        if not flag.item():
            if ok:
                out[-1] = (False, ANOTHER_RANK)
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
    errors_dir = tempfile.mkdtemp(prefix="mtds-gpucheck-errors-")
    try:
        per_rank = spawn(_run_cases, world, fn, cases, setup, None, errors_dir, timeout=timeout, env=env,
                         on=machine.device)
    except Exception as err:            # RankFailure: a rank raised outside a case, or the bound expired
        text = str(err).strip()
        detail = text.splitlines()[0] if text else type(err).__name__
        tail = [line for line in text.splitlines() if line.strip()][-1:] if "\n" in text else []
        what = f"{detail}{' / ' + tail[0].strip() if tail else ''}"[:400]
        return Outcome([], blamed(rank_errors(errors_dir), what), time.monotonic() - start), None
    else:
        cases_out = _name_other_rank(per_rank[-1]["cases"], rank_errors(errors_dir))
        return Outcome(cases_out, None, time.monotonic() - start), per_rank[0]["context"]
    finally:
        shutil.rmtree(errors_dir, ignore_errors=True)


def _name_other_rank(cases: list, errors: list[dict]) -> list:
    """The reporting rank only knows that *another* rank failed its last case: say which, and with what."""
    if cases and not cases[-1][0] and cases[-1][1] == ANOTHER_RANK and errors:
        return cases[:-1] + [(False, f"rank {errors[0]['rank']}: {errors[0]['error']}")]
    return cases
