"""Unit-cost theory of every schedule train.py offers, from simulation of the orders that run:
``mtds.pipe.schedules`` for 1f1b/interleaved/zb-h1, DeepSpeed's own DualPipeVSchedule for dualpipev.
A benchmark puts these next to measured timelines (same bubble definitions as ``timeline``)."""
from __future__ import annotations

from lab.pipe_sim.simulate import SimResult, simulate_schedule

ALL_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "dualpipev")


def simulate_any(name: str, p: int, v: int, m: int, costs: dict | None = None) -> SimResult:
    """Simulated step of schedule ``name`` (v is ignored for dualpipev: two chunks per rank)."""
    if name == "dualpipev":
        from lab.pipe_sim.dualpipev_sim import simulate_deepspeed_dualpipev
        return simulate_deepspeed_dualpipev(p, m, costs)
    return simulate_schedule(name, p, v, m, costs)


def theory_bubble(name: str, p: int, v: int, m: int) -> dict:
    """Unit costs (F = B = W = 1 with W passes, else B = 2): the worst rank's idle / step time
    (``bubble_fraction``, what ``timeline.measured_bubble`` reports) and idle / compute (``bubble_ratio``)."""
    result = simulate_any(name, p, v, m)
    worst = max(range(p), key=lambda r: result.idle[r])
    return {"bubble_fraction": float(result.idle_fraction[worst]), "bubble_ratio": float(result.bubble_ratio[worst])}
