"""Thread CPU time of every ATen call of a block, the calling thread's (not the wall clock: waiting for a core
or for a peer rank costs none), grouped by operator and shape. Python between the calls is the block's thread
CPU without the counter (another step) minus the calls' sum.

    with OpCpu() as ops: ...; ops.table()
"""
from __future__ import annotations

import time
from collections import defaultdict

from torch.utils._python_dispatch import TorchDispatchMode


def _shapes(args) -> str:
    return " ".join("x".join(map(str, a.shape)) for a in args if hasattr(a, "shape"))[:60]


class OpCpu(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ms = defaultdict(float)
        self.calls = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.thread_time_ns()
        out = func(*args, **(kwargs or {}))
        key = (str(func.overloadpacket.__name__), _shapes(args))
        self.ms[key] += (time.thread_time_ns() - t0) / 1e6
        self.calls[key] += 1
        return out

    def rows(self) -> list[dict]:
        return sorted(({"op": k[0], "shapes": k[1], "ms": v, "calls": self.calls[k]} for k, v in self.ms.items()),
                      key=lambda r: -r["ms"])


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of each of this process's threads so far ("name tid" -> user + system), from /proc."""
    import os
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[f"{name} {tid}"] = (int(fields[11]) + int(fields[12])) / tick
    return out
