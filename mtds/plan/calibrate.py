"""Measure this machine (matmul rate curve, element-wise and copy bandwidth, all-reduce cost) into
a device profile.

The profile makes "local" a GPU type for the planner: its measured rates replace datasheet peaks
(see hardware.load_profile). Everything is measured the way training uses it, on every rank at
once (shared cores, memory and loopback are contended as in a real run), and as sustained means
rather than best-of-N single calls, because a training step pays the typical cost of each
operation (the fastest of three such means is kept, to shed bursts of unrelated load):

  * GEMM efficiency as a function of size: square matmuls of n = 64 ... 1024 are timed and fitted
    to the planner's model eff(n) = n / (n + n_half) of a peak rate (compute.gemm_time):
    time per FLOP = (1 / peak) (1 + n_half / n) is linear in 1/n, so one least-squares line
    gives both the peak and n_half;
  * element-wise kernels (GeLU, layer norm, residual add, row max, exp) as bytes moved per second; on a CPU they
    are limited by arithmetic, not by memory bandwidth, so their rate is well below a copy's;
  * the trainer's optimizer step as it runs: torch AdamW (single-tensor loop on CPU, as DeepSpeed builds
    it with torch_adam) after global-norm gradient clipping, on a few large and on many small tensors,
    solved for seconds per parameter and per tensor (host_costs.optimizer_step_time);
  * all-reduce, each call right after a burst of compute (as the tensor-parallel all-reduces
    follow a GEMM), at several sizes, fitted to the ring model t(S) = 2 (n-1) alpha +
    2 (n-1)/n S / busbw (comm.all_reduce); busbw uses the nccl-tests convention.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch

from mtds.parallel import ring
from mtds.plan.hardware import DEFAULT_PROFILE

GEMM_SIZES = (64, 128, 256, 512, 1024)
ALLREDUCE_SIZES = (4 * 2 ** 10, 256 * 2 ** 10, 2 ** 20, 4 * 2 ** 20)


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def _mean_time(fn, seconds: float = 0.2, min_calls: int = 3, repeats: int = 3, sync=None) -> float:
    """Mean seconds per call over a sustained loop of at least `seconds` (after one warm-up call);
    the fastest of `repeats` such loops, so that a burst of unrelated load on a shared machine
    does not become part of the profile (it only ever slows a loop down)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if sync is not None:     # all ranks start each loop together: they contend as a run's ranks do
            sync()
        calls, start = 0, time.perf_counter()
        while calls < min_calls or time.perf_counter() - start < seconds:
            fn()
            calls += 1
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure_matmul(n: int = 1024, dtype=torch.float32, device: str = "cpu", seconds: float = 0.15, sync=None) -> float:
    """Sustained TFLOP/s of an n x n x n matmul (2 n^3 FLOPs)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)

    def run():
        torch.mm(a, b)
        _sync(device)
    return 2.0 * n ** 3 / _mean_time(run, seconds, sync=sync) / 1e12


def fit_gemm_curve(rates: dict[int, float]) -> tuple[float, float]:
    """(peak TFLOP/s, n_half) of eff(n) = n / (n + n_half) fitted to {n: measured TFLOP/s}.

    Least squares of y = 1/rate against x = 1/n: y = 1/peak + (n_half/peak) x."""
    xs = [1.0 / n for n in rates]
    ys = [1.0 / r for r in rates.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    if intercept <= 0:                       # degenerate fit: fall back to the largest size's rate
        return max(rates.values()), 1.0
    return 1.0 / intercept, max(slope / intercept, 1.0)


def measure_memory_bandwidth(nbytes: int = 64 * 2 ** 20, device: str = "cpu", sync=None) -> float:
    """GB/s of a large tensor copy (read + write = 2 x nbytes moved)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)

    def run():
        dst.copy_(src)
        _sync(device)
    return 2.0 * nbytes / _mean_time(run, sync=sync) / 1e9


def measure_elementwise_bandwidth(numel: int = 2 ** 20, device: str = "cpu", sync=None) -> float:
    """GB/s (bytes read + written) of the element-wise kernels of a transformer layer and its
    loss, fp32: tanh-GeLU, layer norm, residual add, and the cross entropy's row max and exp.
    On a CPU their speeds differ several-fold (a row max or exp is arithmetic-bound, a copy is
    not), so one mixed rate stands for all of them."""
    x = torch.randn(numel, device=device)
    y = torch.randn(numel, device=device)
    rows = x.view(-1, 256)

    def run():
        torch.nn.functional.gelu(x, approximate="tanh")
        torch.nn.functional.layer_norm(rows, (256,))
        torch.add(x, y)
        torch.amax(rows, dim=-1)
        torch.exp(x)
        _sync(device)
    moved = 4 * numel * (2 + 2 + 3 + 1 + 2)      # r+w, r+w, 2r+w, r, r+w
    return moved / _mean_time(run, sync=sync) / 1e9


OPTIMIZER_SETS = ((4, 2 ** 18), (256, 256))     # (tensors, elements each): per-parameter vs per-tensor cost


def solve_per_param_and_tensor(samples: dict[tuple[int, int], float]) -> tuple[float, float]:
    """(seconds per parameter, seconds per tensor) of t = a * params + b * tensors through two measured
    (tensors, elements) sets; each clamped at 0 (noise can make the small one negative)."""
    (n1, e1), (n2, e2) = samples
    t1, t2 = samples[(n1, e1)], samples[(n2, e2)]
    p1, p2 = n1 * e1, n2 * e2
    det = p1 * n2 - p2 * n1
    a = (t1 * n2 - t2 * n1) / det
    b = (p1 * t2 - p2 * t1) / det
    if a <= 0:
        return max(t1 / p1, 0.0), 0.0
    return a, max(b, 0.0)


def measure_optimizer(device: str = "cpu", sets=OPTIMIZER_SETS, sync=None) -> tuple[float, float]:
    """(s/param, s/tensor) of one trainer optimizer step: clip_grad_norm_ (DeepSpeed's gradient_clipping),
    torch AdamW with the run's hyper-parameters, gradients dropped after it (zero_grad)."""
    times = {}
    for tensors, numel in sets:
        params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(tensors)]
        grads = [torch.randn(numel, device=device) * 1e-3 for _ in range(tensors)]
        opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

        def run():
            for p, g in zip(params, grads):
                p.grad = g
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
        times[(tensors, numel)] = _mean_time(run, seconds=0.05, sync=sync)
    return solve_per_param_and_tensor(times)


def fit_ring_all_reduce(times: dict[int, float], n: int) -> tuple[float, float]:
    """(bus bandwidth GB/s, per-hop latency s) of t(S) = 2 (n-1) alpha + 2 (n-1)/n S / busbw
    fitted by least squares to {S bytes: mean seconds}."""
    xs, ys = list(times), list(times.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    if slope <= 0:                           # noise swamped the size dependence
        big = max(times)
        slope = times[big] / big
    intercept = max(intercept, min(ys) * 0.5, 1e-7)
    busbw = ring.all_reduce(1.0, n) / slope / 1e9        # link bytes per byte of S, per second
    return busbw, intercept / ring.steps("all_reduce", n)


def measure_all_reduce(group=None, sizes=ALLREDUCE_SIZES, calls: int = 20, repeats: int = 3) -> tuple[float, float, dict]:
    """(bus bandwidth GB/s, per-hop latency s, {size: mean s}) of all-reduces that each follow a
    short burst of compute, as a tensor-parallel all-reduce follows its GEMM: ranks drift apart
    during compute, and the call pays the wait for the slowest one."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"   # NCCL reduces GPU tensors only
    a = torch.randn(256, 256, device=device)
    times = {}
    for size in sizes:
        buf = torch.zeros(size // 4, dtype=torch.float32, device=device)
        dist.all_reduce(buf, group=group)            # warm-up: connections and buffers
        for _ in range(repeats):                     # fastest mean of `repeats` (see _mean_time)
            dist.barrier(group=group)
            spent = 0.0
            for _ in range(calls):
                for _ in range(8):
                    torch.mm(a, a)
                _sync(device)
                start = time.perf_counter()
                dist.all_reduce(buf, group=group)
                _sync(device)
                spent += time.perf_counter() - start
            times[size] = min(times.get(size, float("inf")), spent / calls)
    busbw, latency = fit_ring_all_reduce(times, n)
    return busbw, latency, times


def _measure_compute(device: str = "cpu", sync=None) -> dict:
    """sync: a barrier of the ranks measuring at once, so every loop runs with all of them computing."""
    curve = {n: measure_matmul(n, device=device, sync=sync) for n in GEMM_SIZES}
    peak, half = fit_gemm_curve(curve)
    return {"matmul_tflops": peak, "gemm_half_dim": half,
            "matmul_tflops_by_size": {str(n): r for n, r in curve.items()},
            "memory_gbps": measure_memory_bandwidth(device=device, sync=sync),
            "elementwise_gbps": measure_elementwise_bandwidth(device=device, sync=sync),
            **dict(zip(("optimizer_s_per_param", "optimizer_s_per_tensor"), measure_optimizer(device, sync=sync)))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENGINE_STAGES = (0, 1, 3)


def _worker(rank: int, world: int, port: int, threads: int, queue, engine: bool = False) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # every rank measures at once, so shared cores are contended as in a real run
        result = _measure_compute(sync=dist.barrier)
        dist.barrier()
        result["allreduce_busbw_gbps"], result["allreduce_latency_s"], times = measure_all_reduce()
        result["allreduce_mean_s_by_bytes"] = {str(k): v for k, v in times.items()}
        if engine:
            from mtds.plan.calibrate_engine import measure_engine_overhead
            result["engine_overhead"] = {str(s): measure_engine_overhead(s, sync=dist.barrier) for s in ENGINE_STAGES}
        queue.put((rank, result))
    finally:
        dist.destroy_process_group()


def run_calibration(world_size: int = 2, threads_per_rank: int | None = None, engine: bool = False) -> dict:
    """Measure with `world_size` gloo ranks in-process (or the existing process group). Give the
    number of ranks the runs to predict will place on this host: compute is measured with that many
    processes on the cores at once (contention), not one rank alone. ``engine``: also measure what
    DeepSpeed's engine adds per micro-batch at ZeRO 0, 1 and 3 (mtds.plan.calibrate_engine, ~15 s more)."""
    import torch.distributed as dist

    if world_size < 2:
        raise ValueError(f"calibration needs at least 2 ranks (it fits a ring all-reduce), got {world_size}")

    if dist.is_available() and dist.is_initialized():
        result = _measure_compute("cuda" if dist.get_backend() == "nccl" else "cpu")
        result["allreduce_busbw_gbps"], result["allreduce_latency_s"], _ = measure_all_reduce()
        results = [result]
        world_size, backend = dist.get_world_size(), dist.get_backend()
    else:
        import torch.multiprocessing as mp

        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, threads, queue, engine))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            results = [queue.get(timeout=180)[1] for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        backend = "gloo"
    # a synchronous step runs at the pace of its slowest rank
    prof = {k: min(r[k] for r in results) for k in ("matmul_tflops", "memory_gbps", "elementwise_gbps",
                                                     "allreduce_busbw_gbps")}
    for k in ("optimizer_s_per_param", "optimizer_s_per_tensor"):     # the slowest rank sets the pace
        prof[k] = max(r[k] for r in results)
    slowest = min(results, key=lambda r: r["matmul_tflops"])
    prof["gemm_half_dim"] = slowest["gemm_half_dim"]
    prof["matmul_tflops_by_size"] = slowest["matmul_tflops_by_size"]
    prof["allreduce_latency_s"] = max(r["allreduce_latency_s"] for r in results)
    if "engine_overhead" in results[0]:      # the slowest rank's, stage by stage
        prof["engine_overhead"] = {s: max((r["engine_overhead"][s] for r in results), key=sum)
                                   for s in results[0]["engine_overhead"]}
    if "allreduce_mean_s_by_bytes" in results[0]:
        prof["allreduce_mean_s_by_bytes"] = results[0]["allreduce_mean_s_by_bytes"]
    try:
        if backend == "nccl":      # one GPU per rank: its own memory
            mem_gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2 ** 30
        else:                      # ranks share the host's memory
            mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30 / world_size
    except (ValueError, OSError, AttributeError):
        mem_gib = 8.0
    prof.update({"device": "cuda" if backend == "nccl" else "cpu", "dtype": "fp32", "backend": backend,
                 "devices_per_node": world_size,
                 # every rank measured at once: the rates are per-rank rates with this many processes
                 # sharing the host's cores (host_costs.contention_factor)
                 "concurrency": world_size, "host_cores": os.cpu_count() or 1,
                 "threads_per_rank": torch.get_num_threads() if dist.is_initialized() else threads,
                 "memory_gib": mem_gib, "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return prof


def save_profile(profile: dict, path: str | os.PathLike | None = None) -> Path:
    path = Path(path or DEFAULT_PROFILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n")
    return path
