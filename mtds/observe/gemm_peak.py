"""The GEMM peak of this process on CPU, measured once: the denominator of MFU where no datasheet applies.

A CPU's sustained matmul rate depends on the part, its vector units, the thread count and what else runs
on the cores, so mtds measures it instead of looking it up: a few square ``torch.matmul`` calls at the
run's dtype and thread count (a few milliseconds), the fastest one counted (the least disturbed by other
processes). MFU on CPU is then model FLOP/s of this process over this peak.
"""
from __future__ import annotations

import time

import torch


def cpu_gemm_peak(dtype: torch.dtype = torch.float32, n: int = 512, reps: int = 10) -> float:
    """FLOP/s of ``torch.matmul`` on two n x n matrices in this process (its threads), best of ``reps``.
    ~30 ms at one thread here. Shorter reads low in a fresh process (384³ best of 5: 95 GFLOP/s in three
    of five fresh processes where 512³ best of 10 gave 114-116 in all five): the core has not reached its
    steady speed yet, and a low peak would inflate MFU."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.matmul(a, b)                         # first call: allocation and kernel selection
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best
