"""Process memory and phase timing, measured the same way for both sides of a comparison.

Memory is the resident set of the training process: the peak (``ru_maxrss``, what the OS had to
give) and the RSS right before the model is built (imports + data), so the difference is what
training itself needs. Step phases are wall-clock sums (``time.perf_counter``) over measured steps.
"""
from __future__ import annotations

import resource
import time
from collections import defaultdict
from contextlib import contextmanager

GIB = 2 ** 30


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB   # KiB on Linux


def current_rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / GIB
    return float("nan")


class PhaseTimer:
    """``with timer.phase("forward"): ...``; ``timer.per_step(n)`` -> mean seconds per phase."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.enabled = True

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.enabled:
                self.totals[name] += time.perf_counter() - start

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)
        return timed

    def reset(self) -> None:
        self.totals.clear()

    def per_step(self, steps: int) -> dict[str, float]:
        return {k: v / max(steps, 1) for k, v in self.totals.items()}


def median(values):
    values = sorted(values)
    n = len(values)
    if n == 0:
        return float("nan")
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def top_ops(prof, n: int = 12) -> list[dict]:
    """The ``n`` operators with the most self CPU time in a finished ``torch.profiler`` run."""
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [{"name": e.key, "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in events]


@contextmanager
def maybe_profile(enabled: bool, sink: dict, n: int = 12):
    """Profile the block with torch.profiler (CPU) when enabled; put its top operators in sink['ops']."""
    if not enabled:
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    sink["ops"] = top_ops(prof, n)
