"""The largest micro-batch that fits (GPUs): mtds at (1,1,1) with b, 2b, 4b, ... samples per micro-batch (one
micro-batch per step) until the first CUDA out-of-memory, with tokens/s and MFU per size. A bigger b
usually raises MFU (fewer, larger GEMMs per token), so the size that fits bounds what a user can get.

:func:`sweep` is the arithmetic (the sizes, the stop), independent of the model: it takes ``run(b)``.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from typing import Any, Callable

MAX_MICRO_BATCH = 1024      # the doubling stops here without an OOM: a guard, far above what fits at s = 1024
TIMED_STEPS = 3             # after the warm-up: a median of 3 steps per size keeps the sweep short
CASE = "largest micro-batch that fits (doubling to the first OOM)"


def is_oom(err: BaseException) -> bool:
    """A CUDA out-of-memory: torch's own type, or the message of one raised through another layer."""
    import torch
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def sweep(run: Callable[[int], Any], start: int, limit: int = MAX_MICRO_BATCH) -> list[dict]:
    """``run(b)`` for b = start, 2 start, 4 start, ... <= limit; stops at the first error (an OOM is the
    expected end). One row per size tried: ``{"micro_batch", "ok", "value"}`` or ``{"micro_batch", "ok":
    False, "oom", "error"}``."""
    from mtds.gpucheck.ranks import one_line
    if start < 1:
        raise ValueError(f"micro-batch sweep: start must be >= 1, got {start}")
    rows, b = [], start
    while b <= limit:
        try:
            rows.append({"micro_batch": b, "ok": True, "value": run(b)})
        except Exception as err:        # the end of the sweep, recorded: the sizes before it stand
            rows.append({"micro_batch": b, "ok": False, "oom": is_oom(err), "error": one_line(err)})
            break
        b *= 2
    return rows


def largest(rows: list[dict]) -> int | None:
    """The largest micro-batch that ran, or None."""
    return max((r["micro_batch"] for r in rows if r["ok"]), default=None)


def verdict(rows: list[dict]) -> tuple[bool, str]:
    """(pass, one line): an OOM after at least one size that fit, or the limit reached, passes; an OOM at
    the first size or any other error fails."""
    best, last = largest(rows), rows[-1] if rows else None
    if last is None:
        return False, "no size tried"
    if last["ok"]:
        return True, f"b = {best} fit, the sweep's limit, without an OOM"
    if not last["oom"]:
        return False, f"b = {last['micro_batch']} failed (not an OOM): {last['error']}"
    if best is None:
        return False, f"b = {last['micro_batch']}, the first size, ran out of memory: {last['error']}"
    return True, f"b = {best} fits, b = {last['micro_batch']} ran out of memory"


def _rank_sweep(case) -> list[dict]:
    """In the one rank: the sweep up to ``limit``, each size a fresh mtds run of ``warmup + TIMED_STEPS`` steps."""
    import gc

    import torch

    from mtds.gpucheck.speed import _mtds_side
    workload, precision, warmup, logs, limit = case

    def run(b: int) -> dict:
        w = replace(workload, micro_batch=b, global_batch=b, steps=warmup + TIMED_STEPS)
        try:
            value = _mtds_side(w, precision, warmup, (1, 1, 1), os.path.join(logs, f"sweep-b{b}.jsonl"), profile=False)
        finally:                # the next size starts from an empty cache, not this one's fragments
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if value["step_s"] is None:
            raise RuntimeError(f"b = {b}: no timed step in the log")
        return value

    return sweep(run, workload.micro_batch, limit)


def add_rows(section, rows: list[dict], workload, precision: str, machine) -> None:
    """The sweep into the speed section: a table row per size (tokens/s, MFU, memory; the OOM's row), and one
    PASS/FAIL row with the largest that fit."""
    from mtds.gpucheck.speed import _row
    table, fits = [], []
    for r in rows:
        b = r["micro_batch"]
        name = f"mtds (1,1,1) b = {b}"
        if not r["ok"]:
            table.append({"run": name, "tokens/s": "OOM" if r["oom"] else f"failed: {r['error']}"})
            continue
        row = _row(name, r["value"], replace(workload, micro_batch=b, global_batch=b), precision, machine, 1, b)
        table.append(row)
        fits.append(f"b = {b}: {row['tokens/s']} tokens/s, MFU {row['MFU']}")
    section.table = (section.table or []) + table
    ok, line = verdict(rows)
    section.add(CASE, ok, "; ".join([line] + fits), line)


def check_into(section, machine, workload, precision: str, warmup: int, timeout: float) -> None:
    """Run the sweep on one rank (GPUs; a SKIP row on CPU) and add its rows to the speed ``section``."""
    if not machine.cuda:
        section.skip(CASE, "GPUs only: a CPU rank takes host memory until the machine swaps, there is no "
                           "device OOM to stop at (gpucheck --device cuda runs it)")
        return
    from mtds.gpucheck.ranks import run_cases
    section.intro += (f" Then mtds (1,1,1) at micro-batch {workload.micro_batch}, {2 * workload.micro_batch}, ... "
                      f"(global batch = micro-batch, {warmup} + {TIMED_STEPS} steps each) until the first CUDA "
                      f"OOM: tokens/s and MFU per size, the largest that fits.")
    logs = tempfile.mkdtemp(prefix="mtds-gpucheck-sweep-")
    case = (workload, precision, warmup, logs, MAX_MICRO_BATCH)
    outcome, _ = run_cases(machine, 1, _rank_sweep, [case], timeout=timeout)
    section.seconds += outcome.seconds
    if outcome.error or not outcome.cases[0][0]:
        section.fail(CASE, outcome.error or outcome.cases[0][1])
        return
    add_rows(section, outcome.cases[0][1], workload, precision, machine)
