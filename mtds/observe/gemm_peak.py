"""The GEMM peak of this process on CPU, measured once: the denominator of MFU where no datasheet applies.

A CPU's sustained matmul rate depends on the part, its vector units, the thread count and what else runs
on the cores, so mtds measures it instead of looking it up: a few square ``torch.matmul`` calls at the
run's dtype and thread count (a few milliseconds), the fastest one counted (the least disturbed by other
processes). MFU on CPU is then model FLOP/s of this process over this peak.
"""
from __future__ import annotations

import time

import torch


def cpu_gemm_peak(dtype: torch.dtype = torch.float32, n: int = 512, reps: int = 10, budget_s: float = 0.1) -> float:
    """FLOP/s of ``torch.matmul`` on two n x n matrices in this process (its threads), best of ``reps``.
    ~30 ms at one thread here. Shorter reads low in a fresh process (384³ best of 5: 95 GFLOP/s in three
    of five fresh processes where 512³ best of 10 gave 114-116 in all five): the core has not reached its
    steady speed yet, and a low peak would inflate MFU.
    A kernel the CPU has no instructions for (fp16 here, bf16 on AVX2-only CPUs: ~2 GFLOP/s, 0.1-0.2 s a call)
    is timed within ``budget_s``: the repetitions stop once they have taken it (ten of them cost every rank of
    every such run 2-3 s of start-up)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.matmul(a, b)                         # first call: allocation and kernel selection
    best, spent = float("inf"), 0.0
    for _ in range(reps):
        start = time.perf_counter()
        torch.matmul(a, b)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent >= budget_s:
            break
    return 2.0 * n ** 3 / best
