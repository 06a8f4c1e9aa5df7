"""Where the suite's time goes: wall and machine-wide CPU seconds (user and system, every process: the pooled
ranks, launchers and their ranks included) of each test, written as JSON lines when ``MTDS_TEST_CPU_REPORT``
names a file. The suite on a slower machine (``make test-slow``) and a busy core left idle are read off it:
``python -m lab.testing.cpu_report FILE`` prints the files and tests by wall time with their CPU share.

Machine-wide counters (``/proc/stat``), not the test process's own: a multi-rank body's work is in its pooled
ranks, a launcher test's in grandchildren. Read alone on the machine; another load counts too."""
from __future__ import annotations

import json
import os
import sys
import time

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds() -> tuple[float, float]:
    """(user, system) CPU seconds of the whole machine since boot."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice) / TICK, (system + irq + softirq) / TICK


class CpuReport:
    """A pytest plugin: one JSON line per test (its setup, call and teardown together)."""

    def __init__(self, path: str, launches=lambda: 0):
        self.out = open(path, "a", buffering=1)
        self.launches = launches         # () -> subprocesses the suite has started so far
        self._start: tuple | None = None

    def pytest_runtest_setup(self, item):
        self._start = (time.monotonic(), *cpu_seconds(), self.launches())

    def pytest_runtest_teardown(self, item, nextitem):
        if self._start is None:
            return
        wall0, user0, sys0, procs0 = self._start
        user, system = cpu_seconds()
        self.out.write(json.dumps({"test": item.nodeid, "wall": round(time.monotonic() - wall0, 3),
                                   "user": round(user - user0, 2), "sys": round(system - sys0, 2),
                                   "procs": self.launches() - procs0}) + "\n")
        self._start = None


def summary(path: str, top: int = 25) -> str:
    rows = [json.loads(line) for line in open(path)]
    wall = sum(r["wall"] for r in rows)
    cpu = sum(r["user"] + r["sys"] for r in rows)
    cores = os.cpu_count() or 1
    lines = [f"{len(rows)} tests, {wall:.0f} s wall, {cpu:.0f} s CPU ({cpu / max(wall, 1e-9) / cores:.0%} of "
             f"{cores} cores; system {sum(r['sys'] for r in rows):.0f} s)"]
    per_file: dict[str, list[float]] = {}
    for r in rows:
        acc = per_file.setdefault(r["test"].split("::")[0], [0.0, 0.0, 0])
        acc[0] += r["wall"]
        acc[1] += r["user"] + r["sys"]
        acc[2] += r.get("procs", 0)
    lines.append("\nfiles by wall time: wall s, CPU s, cores busy, subprocesses")
    for name, (w, c, n) in sorted(per_file.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{w:8.1f} {c:8.1f} {c / max(w, 1e-9):5.2f} {n:5d}  {name}")
    lines.append("\ntests by wall time: wall s, CPU s, cores busy, subprocesses")
    for r in sorted(rows, key=lambda r: -r["wall"])[:top]:
        c = r["user"] + r["sys"]
        lines.append(f"{r['wall']:8.1f} {c:8.1f} {c / max(r['wall'], 1e-9):5.2f} {r.get('procs', 0):5d}  {r['test']}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25))
