"""Measure this machine (matmul rate, memory bandwidth, all-reduce bandwidth) into a device profile.

The profile makes "local" a GPU type for the planner: its measured rates replace datasheet
peaks, and all efficiencies are 1 (see calibration.LOCAL_CALIBRATION). Everything takes a few
seconds: one matmul size, one copy, two all-reduce sizes.

All-reduce bus bandwidth uses the NCCL-tests convention: busbw = 2 (n-1)/n * S / t, so a ring
all-reduce of S bytes is predicted back as exactly t (comm.all_reduce).
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch

from mtds.plan.hardware import DEFAULT_PROFILE


def _best_time(fn, repeats: int = 5) -> float:
    fn()  # warm-up (allocations, thread pool start)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul(n: int = 1024, dtype=torch.float32, device: str = "cpu") -> float:
    """Achieved TFLOP/s of an n x n x n matmul (2 n^3 FLOPs)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)

    def run():
        torch.mm(a, b)
        if device != "cpu":
            torch.cuda.synchronize()
    return 2.0 * n ** 3 / _best_time(run) / 1e12


def measure_memory_bandwidth(nbytes: int = 64 * 2 ** 20, device: str = "cpu") -> float:
    """GB/s of a large tensor copy (read + write = 2 x nbytes moved)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _best_time(lambda: dst.copy_(src)) / 1e9


def measure_all_reduce(group=None, sizes=(4096, 16 * 2 ** 20)) -> tuple[float, float]:
    """(bus bandwidth GB/s from the largest size, latency s from the smallest) of an all-reduce."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    times = {}
    for size in sizes:
        buf = torch.zeros(size // 4, dtype=torch.float32)
        times[size] = _best_time(lambda: dist.all_reduce(buf, group=group), repeats=5)
    big, small = max(sizes), min(sizes)
    busbw = 2.0 * (n - 1) / n * big / times[big] / 1e9
    latency = times[small] / (2 * (n - 1))      # per ring step, as comm.all_reduce counts it
    return busbw, latency


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, threads: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # every rank measures at once, so shared cores are contended as in a real run
        result = {"matmul_tflops": measure_matmul(), "memory_gbps": measure_memory_bandwidth()}
        dist.barrier()
        result["allreduce_busbw_gbps"], result["allreduce_latency_s"] = measure_all_reduce()
        queue.put((rank, result))
    finally:
        dist.destroy_process_group()


def run_calibration(world_size: int = 2, threads_per_rank: int | None = None) -> dict:
    """Measure with `world_size` gloo ranks in-process (or the existing process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        busbw, lat = measure_all_reduce()
        results = [{"matmul_tflops": measure_matmul(), "memory_gbps": measure_memory_bandwidth(),
                    "allreduce_busbw_gbps": busbw, "allreduce_latency_s": lat}]
        world_size, backend = dist.get_world_size(), dist.get_backend()
    else:
        import torch.multiprocessing as mp

        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, threads, queue)) for r in range(world_size)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=120)[1] for _ in procs]
        for p in procs:
            p.join(timeout=30)
        backend = "gloo"
    # the slowest rank bounds a synchronous step
    prof = {k: min(r[k] for r in results) for k in ("matmul_tflops", "memory_gbps", "allreduce_busbw_gbps")}
    prof["allreduce_latency_s"] = max(r["allreduce_latency_s"] for r in results)
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30 / world_size
    except (ValueError, OSError, AttributeError):
        mem_gib = 8.0
    prof.update({"device": "cpu", "dtype": "fp32", "backend": backend, "devices_per_node": world_size,
                 "memory_gib": mem_gib, "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return prof


def save_profile(profile: dict, path: str | os.PathLike | None = None) -> Path:
    path = Path(path or DEFAULT_PROFILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n")
    return path
