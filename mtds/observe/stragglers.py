"""Which rank makes the step slow: every N steps the ranks' own step times are gathered and a rank whose work
is slower than ``factor`` x the median rank's is named (log line, JSONL, TensorBoard).

A synchronous step takes the same wall time on every rank -- the fast ranks wait for the slow one inside the
collectives -- so the wall time names nobody. Each rank's step is split into its *wait* (seconds inside the
traced collectives, mtds.observe.comm_trace.clock: gloo's calls block, so this is communication plus waiting
for the peers; on NCCL only launch time is seen, and the split degrades to the step time) and its *compute*
(the rest). The straggler is the rank with the most compute; its peers show the same time as wait.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class Straggler:
    rank: int
    compute_s: float          # its mean compute per step over the interval
    median_s: float           # the median rank's
    ratio: float


def find_stragglers(compute_s: list[float], factor: float) -> list[Straggler]:
    """Ranks whose mean compute per step exceeds ``factor`` x the median over ranks, slowest first."""
    median = statistics.median(compute_s)
    if median <= 0:
        return []
    out = [Straggler(rank, c, median, c / median) for rank, c in enumerate(compute_s) if c > factor * median]
    return sorted(out, key=lambda s: -s.ratio)


def describe(found: list[Straggler], first: int, last: int, wait_s: list[float]) -> str:
    parts = [f"rank {s.rank} computes {s.ratio:.1f}x the median rank ({s.compute_s * 1e3:.0f} vs "
             f"{s.median_s * 1e3:.0f} ms per step; it waits {wait_s[s.rank] * 1e3:.0f} ms, the others up to "
             f"{max(w for r, w in enumerate(wait_s) if r != s.rank) * 1e3:.0f} ms)" for s in found]
    return f"straggler over steps {first}-{last}: " + "; ".join(parts)
