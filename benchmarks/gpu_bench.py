#!/usr/bin/env python
"""One prepared speed run for a lent GPU (`make gpu-bench`): at most 8 minutes on an H100, results written
after every stage, a failed stage recorded and the run going on.

    python benchmarks/gpu_bench.py                         # the GPU run: gpt2-medium, s = 1024, bf16, (1,1,1)
    python benchmarks/gpu_bench.py --dry-run --device cpu  # every stage at tiny shapes (the test-suite's run)
    python benchmarks/gpu_bench.py --stages changes,repeat # a rerun of some stages (results.json of those)
    make gpu-bench GPU_BENCH_ARGS="--dry-run --device cpu"

Stages, in order (each one spawned rank, world of one, killed at the stage's bound):

  host         the host's launch cost: time per tiny kernel launch (1000 one-element adds: enqueue rate and
               the synchronised total), one launch + synchronize round trip, and a tiny model's training
               step (gpt2-tiny, s = 32, b = 1: GPU work negligible, so its step time is the loop's host cost;
               its profile's kernel count gives the host time per kernel); device, torch/CUDA/NCCL/DeepSpeed
               versions, and the peak the MFU figures use
  baseline     gpt2-medium (V = 50304), s = 1024, bf16, (1,1,1), micro-batch 8: HF GPT2LMHeadModel + fused
               AdamW, then mtds (gpucheck's speed functions, the same work): tokens/s, model TFLOP/s, MFU,
               peak memory
  micro-batch  mtds at b = 8, 16, 32 in increasing order, stopping at the first failure (an OOM is recorded);
               b = 8 is the baseline's mtds run (the same run, not repeated)
  profile      one profiled step at the fastest size: the profile mtds's speed run takes of its last
               warm-up step (kernel count, busy vs idle, time by kind), no extra device time; a run of its own
               only when the micro-batch stage has none; the host's launch floor of that step (kernels x the
               host stage's time per kernel) beside it
  compile      mtds at b = 8 eager, then with --compile (Inductor; the dry run: aot_eager); then both again
               with dropout 0.1 (one graph per layer since 2026-11-27: before, four)
  changes      A/B of each speed change behind a bench-only switch, alternated step by step in one run at
               b = 8 (rounds of every configuration, the order rotated each round; the first rounds not
               timed): all changes on vs each one off
  repeat       the baseline again (HF and mtds): two runs 20 minutes apart once differed by 23 %

Writes OUT/results.json (every stage so far, rewritten after each) and appends a section per stage to
OUT/summary.md; each case's step log is in OUT/logs/. OUT: --out, else $OUT, else gpu_bench/. Exit 0 when
every stage ran, 1 when one failed, was cut by its bound or skipped (each recorded with its error).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import os
import statistics
import sys
import time

if __package__ in (None, ""):      # run as a script: make `benchmarks` and `mtds` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STAGES = ("host", "baseline", "micro-batch", "profile", "compile", "changes", "repeat")

# Wall-clock bound per stage on a GPU (seconds), from the H100 run of 2026-11-24 (docs/benchmarks.md,
# docs/gpucheck.md): there a fresh rank running one gpt2-medium case (spawn + imports + model and engine
# build + 12 steps) took ~20-25 s -- gpucheck's speed section, HF and mtds in a fresh rank each, 47 s; with
# a --compile run beside them 91 s, so Inductor's compile costs ~45 s --; the steps themselves are cheap:
# b = 8 is 0.074-0.090 s (mtds) and 0.125 s (HF) a step, b = 32 ~4x that. A further case in the same rank
# skips the spawn and imports (~8 s). Estimates, then the bound (~1.5-2x, or room for b = 32):
#   host         spawn 8 + launches 1 + tiny run 6                          ~15 s   bound  45
#   baseline     spawn 8 + HF 14 + mtds 12                                  ~35 s   bound  65
#   micro-batch  spawn 8 + b = 16 14 + b = 32 18 (b = 8: the baseline's)    ~40 s   bound  80
#   profile      0 (the micro-batch stage's profile); its own run ~25 s     ~0 s    bound  30
#   compile      spawn 8 + 2 x (eager 12 + compiled 12 + Inductor ~45)     ~146 s  bound 130 (H200: 30 s a pair)
#   changes      spawn 8 + one run of 30 steps at ~0.1 s (build 10)         ~21 s   bound  55
#   repeat       as baseline                                                ~35 s   bound  65
# Sum of the estimates ~294 s (5 minutes). Measured on an H200 (2026-11-26, one compile pair): host 21 s,
# baseline 33, micro-batch 30, profile 0, compile 30 (the machine's first Inductor run), changes 21,
# repeat 32 -- so the bounds below (sum 470 s, under the 480 s budget that also caps every bound at the time
# left: the run never passes 8 minutes, + the kill of a stuck rank) leave each stage 2x its H200 time or more.
BOUNDS = {"host": 45, "baseline": 65, "micro-batch": 80, "profile": 30, "compile": 130, "changes": 55, "repeat": 65}
BUDGET_S = 480
DRY_BOUND_S, DRY_BUDGET_S = 180, 1200      # CPU dry run: tiny shapes, but a busy 2-core machine
MIN_STAGE_S = 15                            # less left than this: the stage is skipped (recorded)

PRECISION = "bf16"

# Speed changes behind a bench-only switch (a module attribute, True = the change on): the changes stage
# measures each off against all on.
FLAT = "BF16_Optimizer bookkeeping on flat buffers"
FUSED_CE = "fused cross entropy (--cross-entropy-loss-fusion)"
D1 = "no gradient all-reduce and bf16 round trip at d = 1"
HANDOVER = "16-bit gradients handed over by autograd (no add into a zeroed buffer)"
SWITCHES = {
    # replaces the chunked 16-bit loss's switch (measured 0.903 / 0.947 on the H200, off by default): with both
    # on the fused one runs, so "off: chunked" would have switched nothing
    FUSED_CE: ("mtds.tp.cross_entropy", "FUSED"),
    FLAT: ("mtds.deepspeed_compat.bf16_flat", "FLAT"),
    D1: ("mtds.deepspeed_compat.bf16_flat", "SKIP_SINGLE_RANK_REDUCE"),
    HANDOVER: ("mtds.deepspeed_compat.bf16_flat", "HANDOVER"),
}
# What the off side does more of in the warm-up steps (_PathCounts): proof that the switch switched.
EVIDENCE = {FUSED_CE: "float32_ce", FLAT: "bf16_loops", D1: "d1_allreduce", HANDOVER: "bf16_bound_zeroed"}
# Changes with no switch (one would need more than a module attribute): the baseline measures them, with
# the 2026-11-24 H100 numbers (docs/benchmarks.md) as the before.
BASELINE_ONLY = [
    "vocab-parallel cross entropy's row max with amax (no argmax indices; 091090f): the float32 path's "
    "(the 16-bit path reads its max with amax too)",
    "torch_adam configs fused on CUDA (8541392): not in this run (its DeepSpeed config names fused itself)",
]
BEFORE = "H100, 2026-11-24: mtds 90,649-111,186 tokens/s (MFU 22.2-27.2 %), HF 65,030-65,372 at b = 8"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The shapes and step counts of a run: the GPU run's, or the dry run's tiny ones."""
    model: str                  # gpt2-medium etc. (gpucheck's SPEED_MODELS) or "gpt2-tiny" (dry run)
    seq: int
    sizes: tuple[int, ...]      # micro-batches of the micro-batch stage; the first is the baseline's
    steps: int
    warmup: int
    warm_rounds: int            # changes stage: rounds of every configuration not timed, then timed ones
    timed_rounds: int
    launches: int               # host stage: tiny kernels timed
    compile_backend: str
    dry_run: bool

    @property
    def base(self) -> int:
        return self.sizes[0]

    def model_config(self):
        from mtds.model.config import PRESETS
        if self.model in PRESETS and self.dry_run:
            return PRESETS[self.model]
        from mtds.gpucheck.workloads import speed_workload
        return speed_workload(self.model).model

    def workload(self, micro_batch: int, steps: int | None = None, model=None, seq: int | None = None):
        from mtds.gpucheck.workloads import Workload
        return Workload(model or self.model_config(), seq or self.seq, micro_batch, micro_batch, steps or self.steps)

    def tiny(self):
        """The host stage's tiny model: gpt2-tiny at s = 32, b = 1 (the GPU's work per kernel is negligible)."""
        from mtds.model.config import PRESETS
        return self.workload(1, self.steps, model=PRESETS["gpt2-tiny"], seq=32)


def plan_for(args) -> Plan:
    if args.dry_run:
        return Plan("gpt2-tiny", 32, (1, 2), 2, 1, 1, 1, 200, "aot_eager", True)
    return Plan(args.model, 1024, tuple(args.sizes), args.steps, args.warmup, 2, 8, 1000, "inductor", False)


# ---------------------------------------------------------------------------------------------------------
# In the spawned rank


def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _launch_costs(device, n: int) -> dict:
    """Tiny kernel launches: n one-element adds (enqueue time and the synchronised total, best of 5), and
    launch + synchronize round trips."""
    import torch
    x = torch.zeros(1, device=device)
    for _ in range(50):
        x.add_(1)
    _sync(device)
    enqueue, total = [], []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            x.add_(1)
        queued = time.perf_counter()
        _sync(device)
        end = time.perf_counter()
        enqueue.append((queued - start) / n)
        total.append((end - start) / n)
    trips = max(10, n // 10)
    start = time.perf_counter()
    for _ in range(trips):
        x.add_(1)
        _sync(device)
    round_trip = (time.perf_counter() - start) / trips
    start = time.perf_counter()
    for _ in range(n):
        pass
    loop = (time.perf_counter() - start) / n
    return {"launches_timed": n, "launch_enqueue_us": min(enqueue) * 1e6, "launch_synced_us": min(total) * 1e6,
            "launch_sync_round_trip_us": round_trip * 1e6, "python_loop_iteration_us": loop * 1e6}


def _host(case: dict) -> dict:
    import platform

    import torch

    from mtds.gpucheck.machine import versions
    from mtds.gpucheck.speed import _mtds_side
    from mtds.observe.metrics import peak_tflops
    from mtds.training.distributed import group_device
    device = group_device()
    out = {"device_type": device.type, "versions": versions(), "host_cpus": os.cpu_count(),
           "platform": platform.platform()}
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
        out["peak_tflops"] = peak_tflops(out["device_name"], PRECISION)
        out["peak_source"] = f"datasheet dense {PRECISION} (mtds.observe.metrics)"
    else:
        from mtds.observe.gemm_peak import cpu_gemm_peak
        out["device_name"] = f"CPU ({platform.processor() or platform.machine()})"
        out["peak_tflops"] = cpu_gemm_peak(torch.bfloat16) / 1e12
        out["peak_source"] = "this rank's measured bf16 GEMM rate (mtds.observe.gemm_peak)"
    out.update(_launch_costs(device, case["launches"]))
    tiny = _mtds_side(case["workload"], PRECISION, case["warmup"], (1, 1, 1), case["log"])
    out["tiny_step_s"] = tiny["step_s"]
    profile = tiny.get("profile")
    if profile and profile.get("launches"):
        out["tiny_kernels_per_step"] = profile["launches"]
        out["tiny_profiled_wall_ms"] = profile["wall_ms"]
        out["tiny_profiled_busy_ms"] = profile["busy_ms"]
        out["host_us_per_kernel"] = tiny["step_s"] / profile["launches"] * 1e6
    return out


def _set_switches(values: dict) -> None:
    for name, on in values.items():
        module, attr = SWITCHES[name]
        setattr(importlib.import_module(module), attr, on)


class _PathCounts:
    """Which code path each configuration took, counted in the warm-up steps only (the timed steps run the
    product's functions unwrapped): the chunked 16-bit, the float32 and the fused cross entropy, the flat and
    the per-parameter BF16_Optimizer accumulation (calls). Evidence that a switch switched."""

    def __init__(self, configs):
        import mtds.deepspeed_compat.bf16_flat as flat
        import mtds.tp.cross_entropy as ce
        import mtds.tp.fused_cross_entropy as fused
        self.targets = [(ce, "_ChunkedCrossEntropy16", "chunked_16bit_ce"),
                        (ce, "_VocabParallelCrossEntropy", "float32_ce"), (fused, "FusedCrossEntropy", "fused_ce"),
                        (flat, "accumulate_flat", "bf16_flat"), (flat, "deepspeed_loops", "bf16_loops"),
                        (flat, "deepspeed_reduce", "d1_allreduce"),
                        (flat, "zero_bound", "bf16_bound_zeroed")]
        self.originals = {(m, name): getattr(m, name) for m, name, _ in self.targets}
        self.counts = {config: {key: 0 for _, _, key in self.targets} for config in configs}
        self.config, self.installed = None, False

    def _counting(self, fn, key):
        def call(*args, **kwargs):
            self.counts[self.config][key] += 1
            return fn(*args, **kwargs)
        return call

    def install(self, config: str) -> None:
        import types
        self.config = config
        if self.installed:
            return
        for m, name, key in self.targets:
            fn = self.originals[(m, name)]
            setattr(m, name, types.SimpleNamespace(apply=self._counting(fn.apply, key)) if isinstance(fn, type)
                    else self._counting(fn, key))
        self.installed = True

    def remove(self) -> None:
        for (m, name), fn in self.originals.items():
            setattr(m, name, fn)
        self.installed = False


def _alternating(case: dict) -> dict:
    """mtds with the switches set per step from ``case["schedule"]`` (the step loop's train_step wrapped for
    this run only); the step times per configuration from its log, the paths taken from the warm-up steps."""
    import mtds.tp.fused_cross_entropy as fused
    import mtds.training.train_loop as loop
    from mtds.gpucheck.speed import _mtds_side
    original, schedule, configs, warmup = loop.train_step, case["schedule"], case["configs"], case["warmup"]
    pieces = fused.pieces       # the fused loss's compiler: the plan's (the dry run: aot_eager, as its --compile)
    fused.pieces = lambda backend="inductor": pieces(case["backend"])
    paths = _PathCounts(configs)
    calls = [0]

    def train_step(*args, **kwargs):
        config = schedule[min(calls[0], len(schedule) - 1)]
        _set_switches(configs[config])
        if calls[0] < warmup:
            paths.install(config)
        else:
            paths.remove()
        calls[0] += 1
        return original(*args, **kwargs)

    loop.train_step = train_step
    try:
        value = _mtds_side(case["workload"], PRECISION, warmup, (1, 1, 1), case["log"])
    finally:
        loop.train_step, fused.pieces = original, pieces
        paths.remove()
    value["paths_in_warmup"] = paths.counts
    with open(case["log"]) as f:
        records = [r for r in map(json.loads, f) if r.get("kind") == "train"]
    value["steps"] = [{"step": r["step"], "config": schedule[r["step"] - 1], "step_s": r["step_time_s"]}
                      for r in records]
    value["calls"] = calls[0]
    return value


def _run_case(case: dict) -> dict:
    from mtds.gpucheck.speed import _hf_side, _mtds_side
    kind = case["kind"]
    if kind == "host":
        return _host(case)
    if kind == "hf":
        return _hf_side(case["workload"], PRECISION, case["warmup"])
    if kind == "alternating":
        return _alternating(case)
    if not case.get("compile"):
        return _mtds_side(case["workload"], PRECISION, case["warmup"], (1, 1, 1), case["log"])
    import functools

    import torch._dynamo

    import mtds.model.compile as mtds_compile
    original = mtds_compile.compile_layers
    mtds_compile.compile_layers = functools.partial(original, backend=case["backend"])
    try:
        return _mtds_side(case["workload"], PRECISION, case["warmup"], (1, 1, 1), case["log"], compile=True)
    finally:
        mtds_compile.compile_layers = original
        torch._dynamo.reset()


def _stage_rank(stage: str, cases: list[dict], partial: str, stop_on_failure: bool) -> list[dict]:
    """Every case of a stage in this rank, in order; each record is appended to ``partial`` as it ends (a
    stage cut by its bound keeps what finished). The switches are put back after every case."""
    import gc
    defaults = {name: getattr(importlib.import_module(m), a) for name, (m, a) in SWITCHES.items()}
    # DeepSpeed's engine set-up calls gc.collect() 4 times (see_memory_usage), each walking every object the
    # imports made (0.24 s apiece on a CPU core here): imported first and frozen, they are not walked (the
    # cases' own objects still are)
    for module in ("deepspeed", "transformers", "mtds.training", "mtds.gpucheck.speed", "mtds.gpucheck.reference"):
        importlib.import_module(module)
    gc.collect()
    gc.freeze()
    try:
        return _cases(cases, partial, stop_on_failure, defaults)
    finally:
        gc.unfreeze()


def _cases(cases: list[dict], partial: str, stop_on_failure: bool, defaults: dict) -> list[dict]:
    import gc

    import torch

    from mtds.gpucheck.microbatch import is_oom
    from mtds.gpucheck.ranks import one_line
    out = []
    for case in cases:
        start = time.monotonic()
        record = {"case": case["name"], "kind": case["kind"], "micro_batch": case.get("micro_batch")}
        try:
            record.update(ok=True, **_run_case(case))
        except Exception as err:        # recorded; the stage stops here only where asked (micro-batch)
            record.update(ok=False, error=one_line(err), oom=is_oom(err))
        finally:
            _set_switches(defaults)
        record["seconds"] = time.monotonic() - start
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
            # a DeepSpeed engine outlives its run (its gradient hooks close a cycle gc cannot see) until the
            # next run's set-up lets it go (seen on CPU: gone before the next run's first step, so the next
            # run's peak, taken in its steps, holds none of it); recorded, not assumed
            record["leftover_allocated_gib"] = torch.cuda.memory_allocated() / 2 ** 30
        out.append(record)
        with open(partial, "a") as f:
            f.write(json.dumps(record, default=_plain) + "\n")
        if not record["ok"] and stop_on_failure:
            break
    return json.loads(json.dumps(out, default=_plain))


def _plain(value):
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


# ---------------------------------------------------------------------------------------------------------
# In the parent: stages, numbers, the files


@dataclasses.dataclass
class Context:
    plan: Plan
    device: str
    out: str
    stages: dict = dataclasses.field(default_factory=dict)      # stage -> record (results.json's "stages")
    peak: float | None = None
    host_us_per_kernel: float | None = None
    profiles: dict = dataclasses.field(default_factory=dict)    # micro-batch -> its run's step profile
    baseline_mtds: dict | None = None                           # the baseline stage's mtds record


def _failure(err: BaseException) -> str:
    """One line of a spawn failure: its first line and the traceback's last (the exception)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    text = lines[0] if len(lines) == 1 else f"{lines[0]} / {lines[-1]}"
    return f"{type(err).__name__}: {text}"[:500]


def _spawn_stage(ctx: Context, stage: str, cases: list[dict], bound: float,
                 stop_on_failure: bool = False) -> tuple[list[dict], str | None]:
    """The stage's cases on one spawned rank, killed at ``bound``: (records, None), or (those that finished,
    the error) when the rank failed or ran past the bound, or a case failed (an out-of-memory case only
    where ``stop_on_failure``: the micro-batch stage's expected end)."""
    from mtds.local_ranks.spawn import spawn
    partial = os.path.join(ctx.out, "logs", f"{stage}.cases.jsonl")
    if os.path.exists(partial):
        os.remove(partial)
    for i, case in enumerate(cases):
        case.setdefault("log", os.path.join(ctx.out, "logs", f"{stage}-{i}-{case['name']}.jsonl".replace(" ", "_")))
    try:
        done = spawn(_stage_rank, 1, stage, cases, partial, stop_on_failure, timeout=bound, on=ctx.device)[0]
    except Exception as err:            # RankFailure: the rank died or ran past the bound
        done = []
        if os.path.exists(partial):
            with open(partial) as f:
                done = [json.loads(line) for line in f if line.strip()]
        return done, _failure(err)
    bad = [r for r in done if not r["ok"] and not (stop_on_failure and r.get("oom"))]
    return done, (f"{bad[0]['case']}: {bad[0]['error']}" if bad else None)


def numbers(ctx: Context, record: dict, seq: int | None = None, model=None) -> dict:
    """tokens/s, model TFLOP/s, MFU and peak memory of one case (global batch = micro-batch, one rank)."""
    from mtds.observe.metrics import model_config_flops
    step = record.get("step_s")
    b = record["micro_batch"]
    if not record.get("ok") or not step:
        return {"error": record.get("error") or "no step time"}
    seq = seq or ctx.plan.seq
    tflops = model_config_flops(model or ctx.plan.model_config(), b, seq) / step / 1e12
    return {"micro_batch": b, "step_s": step, "tokens_per_s": b * seq / step, "model_tflops": tflops,
            "mfu": tflops / ctx.peak if ctx.peak else None, "peak_allocated_gib": record.get("allocated_gib"),
            "peak_reserved_gib": record.get("reserved_gib"), "first_loss": record.get("first_loss"),
            "case_seconds": record.get("seconds")}


def _case(name: str, kind: str, plan: Plan, b: int, **extra) -> dict:
    return {"name": name, "kind": kind, "micro_batch": b, "workload": plan.workload(b), "warmup": plan.warmup,
            **extra}


def stage_host(ctx: Context, bound: float) -> dict:
    plan = ctx.plan
    case = {"name": "host", "kind": "host", "micro_batch": 1, "workload": plan.tiny(), "warmup": plan.warmup,
            "launches": plan.launches}
    records, error = _spawn_stage(ctx, "host", [case], bound)
    if not records or not records[0]["ok"]:
        return {"error": error or records[0]["error"]}
    r = records[0]
    ctx.peak = r.get("peak_tflops")
    ctx.host_us_per_kernel = r.get("host_us_per_kernel")
    keep = ("device_name", "device_type", "versions", "host_cpus", "platform", "peak_tflops", "peak_source",
            "launches_timed", "launch_enqueue_us", "launch_synced_us", "launch_sync_round_trip_us",
            "python_loop_iteration_us", "tiny_step_s", "tiny_kernels_per_step", "tiny_profiled_wall_ms",
            "tiny_profiled_busy_ms", "host_us_per_kernel")
    return {**{k: r.get(k) for k in keep}, "case_seconds": r["seconds"], "error": error}


def _pair(ctx: Context, stage: str, bound: float) -> dict:
    """HF, then mtds, at the base micro-batch (baseline and repeat)."""
    plan = ctx.plan
    cases = [_case("hf", "hf", plan, plan.base), _case("mtds", "mtds", plan, plan.base)]
    records, error = _spawn_stage(ctx, stage, cases, bound)
    got = {r["case"]: r for r in records}
    if stage == "baseline" and got.get("mtds", {}).get("ok"):
        ctx.baseline_mtds = got["mtds"]     # the micro-batch stage's first size
    out = {"micro_batch": plan.base, "seq": plan.seq, "model": plan.model, "precision": PRECISION}
    for side in ("hf", "mtds"):
        out[side] = numbers(ctx, got[side]) if side in got else {"error": error or "not run"}
    h, m = out["hf"], out["mtds"]
    if "tokens_per_s" in h and "tokens_per_s" in m:
        out["mtds_over_hf"] = m["tokens_per_s"] / h["tokens_per_s"]
        if h.get("first_loss") and m.get("first_loss"):
            out["first_loss_rel_diff"] = abs(m["first_loss"] - h["first_loss"]) / abs(h["first_loss"])
    out["error"] = error
    return out


def stage_baseline(ctx: Context, bound: float) -> dict:
    return _pair(ctx, "baseline", bound)


def stage_repeat(ctx: Context, bound: float) -> dict:
    out = _pair(ctx, "repeat", bound)
    base = ctx.stages.get("baseline", {})
    for side in ("hf", "mtds"):
        now, before = out[side].get("tokens_per_s"), base.get(side, {}).get("tokens_per_s")
        if now and before:
            out[f"{side}_repeat_over_baseline"] = now / before
    return out


def stage_micro_batch(ctx: Context, bound: float) -> dict:
    plan = ctx.plan
    # the baseline's mtds run is this stage's first size (same run, same settings): not run twice
    reused = [dict(ctx.baseline_mtds, source="the baseline stage's run")] if ctx.baseline_mtds else []
    cases = [_case(f"b={b}", "mtds", plan, b) for b in plan.sizes[len(reused):]]
    records, error = _spawn_stage(ctx, "micro-batch", cases, bound, stop_on_failure=True) if cases else ([], None)
    records = reused + records
    rows, profiles = [], {}
    for r in records:
        row = numbers(ctx, r)
        row["micro_batch"] = r["micro_batch"]
        row["source"] = r.get("source", "this stage")
        if not r["ok"]:
            row["oom"] = r.get("oom", False)
        rows.append(row)
        if r.get("profile"):
            profiles[r["micro_batch"]] = r["profile"]
    fine = [row for row in rows if "tokens_per_s" in row]
    best = max(fine, key=lambda row: row["tokens_per_s"])["micro_batch"] if fine else None
    oom = next((row["micro_batch"] for row in rows if row.get("oom")), None)
    not_run = [b for b in plan.sizes if b not in {r["micro_batch"] for r in records}]
    ctx.profiles = profiles
    return {"sizes": list(plan.sizes), "rows": rows, "best_micro_batch": best, "first_oom_micro_batch": oom,
            "not_run": not_run, "error": error}


def _profile_numbers(ctx: Context, profile: dict, step_s: float | None) -> dict:
    wall, busy = profile["wall_ms"], profile["busy_ms"]
    out = {"device": profile["device"], "kernels": profile["launches"], "profiled_wall_ms": wall, "busy_ms": busy,
           "idle_ms": max(0.0, wall - busy), "busy_fraction": busy / wall if wall else None,
           "by_kind": [{"kind": k, "ms": ms, "count": n, "share": ms / busy if busy else None}
                       for k, ms, n in profile["rows"]], "unprofiled_step_s": step_s}
    if ctx.host_us_per_kernel:
        floor = profile["launches"] * ctx.host_us_per_kernel / 1e3
        out["host_launch_floor_ms"] = floor         # kernels x the host's time per kernel in a tiny step
        if step_s:
            out["host_floor_over_step"] = floor / (step_s * 1e3)
    return out


def stage_profile(ctx: Context, bound: float) -> dict:
    micro = ctx.stages.get("micro-batch", {})
    best, profiles = micro.get("best_micro_batch"), ctx.profiles
    if best is not None and best in profiles:
        step = next((r.get("step_s") for r in micro["rows"] if r.get("micro_batch") == best), None)
        return {"micro_batch": best, "source": f"the micro-batch stage's b = {best} run (its last warm-up step)",
                "profiled_step": ctx.plan.warmup, **_profile_numbers(ctx, profiles[best], step), "error": None}
    plan = ctx.plan
    b = best or plan.base
    case = _case(f"profile b={b}", "mtds", plan, b)
    case["workload"] = plan.workload(b, steps=plan.warmup + 1)
    records, error = _spawn_stage(ctx, "profile", [case], bound)
    if not records or not records[0]["ok"] or not records[0].get("profile"):
        return {"micro_batch": b, "error": error or (records[0].get("error") if records else None) or "no profile"}
    r = records[0]
    return {"micro_batch": b, "source": "a run of its own", "profiled_step": plan.warmup,
            **_profile_numbers(ctx, r["profile"], r.get("step_s")), "error": error}


COMPILE_DROPOUT = 0.1      # the compile stage's second pair: GPT-2's own dropout, the RNG keying in the graph


def stage_compile(ctx: Context, bound: float) -> dict:
    plan = ctx.plan
    dropout = dataclasses.replace(plan.model_config(), hidden_dropout=COMPILE_DROPOUT, attention_dropout=COMPILE_DROPOUT)
    cases = [_case("eager", "mtds", plan, plan.base),
             _case("compile", "mtds", plan, plan.base, compile=True, backend=plan.compile_backend),
             dict(_case("eager-dropout", "mtds", plan, plan.base), workload=plan.workload(plan.base, model=dropout)),
             dict(_case("compile-dropout", "mtds", plan, plan.base, compile=True, backend=plan.compile_backend),
                  workload=plan.workload(plan.base, model=dropout))]
    records, error = _spawn_stage(ctx, "compile", cases, bound)
    got = {r["case"]: r for r in records}
    out = {"micro_batch": plan.base, "backend": plan.compile_backend, "dropout": COMPILE_DROPOUT}
    for name in ("eager", "compile", "eager-dropout", "compile-dropout"):
        out[name] = numbers(ctx, got[name]) if name in got else {"error": error or "not run"}
    for key, (eager, compiled) in (("compile_speedup", ("eager", "compile")),
                                   ("compile_speedup_dropout", ("eager-dropout", "compile-dropout"))):
        if "step_s" in out[eager] and "step_s" in out[compiled]:
            out[key] = out[eager]["step_s"] / out[compiled]["step_s"]
    out["error"] = error
    return out


def changes_schedule(names: list[str], warm_rounds: int, timed_rounds: int) -> list[str]:
    """Rounds of every configuration, the order rotated by one each round (each takes each position as
    often); the first ``warm_rounds`` rounds are the warm-up."""
    out = []
    for r in range(warm_rounds + timed_rounds):
        k = r % len(names)
        out += names[k:] + names[:k]
    return out


def stage_changes(ctx: Context, bound: float) -> dict:
    plan = ctx.plan
    configs = {"all on": {name: True for name in SWITCHES}}
    for name in SWITCHES:
        configs[f"off: {name}"] = {other: other != name for other in SWITCHES}
    names = list(configs)
    schedule = changes_schedule(names, plan.warm_rounds, plan.timed_rounds)
    warmup = plan.warm_rounds * len(names)
    case = _case("alternating", "alternating", plan, plan.base, schedule=schedule, configs=configs, warmup=warmup,
                 backend=plan.compile_backend)
    case["workload"] = plan.workload(plan.base, steps=len(schedule))
    records, error = _spawn_stage(ctx, "changes", [case], bound)
    out = {"micro_batch": plan.base, "switches": {n: ".".join(SWITCHES[n]) for n in SWITCHES},
           "schedule": schedule, "warmup_steps": warmup, "measured_by_the_baseline_only": BASELINE_ONLY}
    if not records or not records[0]["ok"]:
        out["error"] = error or (records[0]["error"] if records else "not run")
        return out
    r = records[0]
    timed = [s for s in r["steps"] if s["step"] > warmup]
    per = {}
    for name in names:
        times = [s["step_s"] for s in timed if s["config"] == name]
        row = numbers(ctx, {"ok": bool(times), "step_s": statistics.median(times) if times else None,
                            "micro_batch": plan.base, "error": "no timed step"})
        row["steps_timed"] = len(times)
        per[name] = row
    out["configs"] = per
    rounds = [timed[i:i + len(names)] for i in range(0, len(timed), len(names))]
    effects = {}
    for name in SWITCHES:
        off = f"off: {name}"
        paired = []
        for rnd in rounds:
            t = {s["config"]: s["step_s"] for s in rnd}
            if off in t and "all on" in t:
                paired.append(t[off] / t["all on"])
        on_s, off_s = per["all on"].get("step_s"), per[off].get("step_s")
        effects[name] = {"speedup_of_change": off_s / on_s if on_s and off_s else None,
                         "paired_off_over_on": paired,
                         "paired_median": statistics.median(paired) if paired else None}
    out["effects"] = effects
    paths = r.get("paths_in_warmup", {})
    out["paths_in_warmup"] = paths
    switched = {name: paths.get(f"off: {name}", {}).get(key, 0) > paths.get("all on", {}).get(key, 0)
                for name, key in EVIDENCE.items()}
    out["switch_took_effect"] = switched
    dead = [name for name, ok in switched.items() if not ok]
    if dead and not error:
        error = f"switch changed no code path in the warm-up steps: {', '.join(dead)} (the A/B measured nothing)"
    out["peak_allocated_gib"] = r.get("allocated_gib")
    out["error"] = error
    return out


STAGE_FUNCS = {"host": stage_host, "baseline": stage_baseline, "micro-batch": stage_micro_batch,
               "profile": stage_profile, "compile": stage_compile, "changes": stage_changes, "repeat": stage_repeat}


# ---------------------------------------------------------------------------------------------------------
# The files


def _fmt(x, spec=",.0f", unit=""):
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:{spec}}{unit}"


def _pct(x):
    return "–" if x is None else f"{x:.1%}"


def _speed_table(rows: list[tuple[str, dict]]) -> list[str]:
    lines = ["| run | tokens/s | step s | model TFLOP/s | MFU | peak alloc GiB (CPU: RSS) | peak reserved GiB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows:
        if "tokens_per_s" not in r or "step_s" not in r:
            lines.append(f"| {name} | error: {str(r.get('error')).replace('|', '/')} | | | | | |")
            continue
        lines.append(f"| {name} | {_fmt(r['tokens_per_s'])} | {r['step_s']:.4f} | {_fmt(r['model_tflops'], '.3g')} | "
                     f"{_pct(r['mfu'])} | {_fmt(r['peak_allocated_gib'], '.2f')} | "
                     f"{_fmt(r['peak_reserved_gib'], '.2f')} |")
    return lines


def render_stage(stage: str, rec: dict) -> list[str]:
    head = f"## {stage}: {rec['status']} ({rec['seconds']:.0f} s of a {rec['bound_s']:.0f} s bound)"
    lines = [head, ""]
    if rec.get("error"):
        lines += [f"error: {rec['error']}", ""]
    if stage == "host" and rec.get("device_name"):
        v = rec["versions"]
        lines += [f"- device: {rec['device_name']}, {rec['host_cpus']} host CPUs; torch {v['torch']} (CUDA "
                  f"{v['cuda']}), NCCL {v['nccl']}, DeepSpeed {v['deepspeed']}, transformers {v['transformers']}, "
                  f"Python {v['python']}",
                  f"- peak for MFU: {_fmt(rec['peak_tflops'], '.4g')} TFLOP/s ({rec['peak_source']})",
                  f"- tiny kernel launch: {rec['launch_enqueue_us']:.2f} us enqueued, {rec['launch_synced_us']:.2f} us "
                  f"synchronised ({rec['launches_timed']} one-element adds); launch + synchronize "
                  f"{rec['launch_sync_round_trip_us']:.1f} us; empty Python loop "
                  f"{rec['python_loop_iteration_us']:.3f} us",
                  f"- tiny model's step (gpt2-tiny, s = 32, b = 1): "
                  f"{_fmt(rec['tiny_step_s'] and rec['tiny_step_s'] * 1e3, '.2f', ' ms')}, "
                  f"{_fmt(rec.get('tiny_kernels_per_step'), ',')} kernels: "
                  f"{_fmt(rec.get('host_us_per_kernel'), '.2f', ' us')} of host time per kernel", ""]
    elif stage in ("baseline", "repeat"):
        lines += _speed_table([("HF GPT2LMHeadModel + AdamW", rec.get("hf", {})),
                               ("mtds (1,1,1)", rec.get("mtds", {}))])
        lines += ["", f"mtds / HF: {_fmt(rec.get('mtds_over_hf'), '.2f')}; first-step loss relative difference "
                      f"{_fmt(rec.get('first_loss_rel_diff'), '.1e')} (same work: small)"]
        if stage == "repeat":
            lines += [f"repeat / baseline: mtds {_fmt(rec.get('mtds_repeat_over_baseline'), '.3f')}, HF "
                      f"{_fmt(rec.get('hf_repeat_over_baseline'), '.3f')}"]
        else:
            lines += [f"before: {BEFORE}"]
        lines += [""]
    elif stage == "micro-batch":
        lines += _speed_table([(f"mtds b = {r['micro_batch']}" + (" (OOM)" if r.get("oom") else "") +
                                (" (the baseline's run)" if r.get("source", "").startswith("the baseline") else ""), r)
                               for r in rec.get("rows", [])])
        lines += ["", f"fastest: b = {rec.get('best_micro_batch')}; first OOM: {rec.get('first_oom_micro_batch')}; "
                      f"not run: {rec.get('not_run') or 'none'}", ""]
    elif stage == "profile" and "kernels" in rec:
        what = "kernels" if rec["device"] == "cuda" else "operators"
        lines += [f"b = {rec['micro_batch']}, {rec['source']}: {rec['kernels']:,} {what}, busy {rec['busy_ms']:.1f} ms "
                  f"of {rec['profiled_wall_ms']:.1f} ms profiled ({_pct(rec['busy_fraction'])}; idle "
                  f"{rec['idle_ms']:.1f} ms); unprofiled step {_fmt(rec['unprofiled_step_s'], '.4f', ' s')}; host "
                  f"launch floor {_fmt(rec.get('host_launch_floor_ms'), '.1f', ' ms')} "
                  f"({_pct(rec.get('host_floor_over_step'))} of the step"
                  f"{'' if rec['device'] == 'cuda' else '; CPU: the operators run on the host, so no launch floor'})",
                  "",
                  f"| kind of work | ms | share | {what} |", "|---|---:|---:|---:|"]
        lines += [f"| {k['kind']} | {k['ms']:.2f} | {_pct(k['share'])} | {k['count']:,} |" for k in rec["by_kind"]]
        lines += [""]
    elif stage == "compile":
        drop = rec.get("dropout")
        lines += _speed_table([("mtds eager", rec.get("eager", {})),
                               (f"mtds --compile ({rec.get('backend')})", rec.get("compile", {})),
                               (f"mtds eager, dropout {drop}", rec.get("eager-dropout", {})),
                               (f"mtds --compile ({rec.get('backend')}), dropout {drop}", rec.get("compile-dropout", {}))])
        lines += ["", f"compiled / eager speed: {_fmt(rec.get('compile_speedup'), '.3f')}; with dropout "
                  f"{_fmt(rec.get('compile_speedup_dropout'), '.3f')}", ""]
    elif stage == "changes":
        if rec.get("configs"):
            lines += _speed_table(list(rec["configs"].items()))
            lines += ["", "| change | eager speed-up (off / on, medians) | paired off / on per round |",
                      "|---|---:|---|"]
            for name, e in rec.get("effects", {}).items():
                paired = ", ".join(f"{x:.3f}" for x in e["paired_off_over_on"])
                lines.append(f"| {name} | {_fmt(e['speedup_of_change'], '.3f')} | {paired} |")
            lines += ["", "Paths taken in the warm-up steps (per configuration): "
                          f"{json.dumps(rec.get('paths_in_warmup'))}"
                          f"; switch took effect: {json.dumps(rec.get('switch_took_effect'))}", ""]
        lines += ["Measured by the baseline only (no switch): " + "; ".join(rec.get("measured_by_the_baseline_only",
                                                                                    [])), ""]
    return lines


def _write(ctx: Context, meta: dict, stage: str | None) -> None:
    """results.json (every stage so far; written to a temporary name, then renamed) and, for ``stage``, its
    section appended to summary.md."""
    path = os.path.join(ctx.out, "results.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "stages": ctx.stages}, f, indent=1, default=_plain)
    os.replace(tmp, path)
    if stage is not None:
        rec = ctx.stages[stage]
        try:
            lines = render_stage(stage, rec)
        except Exception as err:        # a record the summary cannot show: results.json has it all
            lines = [f"## {stage}: {rec.get('status')} ({rec.get('seconds', 0):.0f} s)", "",
                     f"error: {rec.get('error')}", f"(not rendered: {type(err).__name__}: {err})", ""]
        with open(os.path.join(ctx.out, "summary.md"), "a") as f:
            f.write("\n".join(lines) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--dry-run", action="store_true", help="every stage at tiny shapes (gpt2-tiny, s = 32, b = 1/2, "
                    "2 steps; --model/--sizes/--steps/--warmup ignored): the CPU run that exercises the script")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: CUDA when torch sees one")
    ap.add_argument("--out", help="output directory [$OUT, else gpu_bench]")
    ap.add_argument("--stages", help=f"comma-separated subset of {','.join(STAGES)} [all]")
    ap.add_argument("--model", default="gpt2-medium", help="GPU: gpt2-medium, gpt2-large or gpt2-xl [gpt2-medium]")
    ap.add_argument("--sizes", default="8,16,32", help="micro-batches, the first the baseline's [8,16,32]")
    ap.add_argument("--steps", type=int, default=12, help="steps per run [12]")
    ap.add_argument("--warmup", type=int, default=3, help="first steps not timed [3]")
    ap.add_argument("--budget", type=float, help=f"seconds for the whole run [{BUDGET_S}; dry run {DRY_BUDGET_S}]")
    args = ap.parse_args(argv)
    try:
        args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sizes: comma-separated integers, got {args.sizes!r}")
    if not args.sizes or min(args.sizes) < 1:
        ap.error("--sizes: at least one micro-batch, each >= 1")
    if not 1 <= args.warmup < args.steps:
        ap.error("--warmup must be at least 1 (the profiled step) and below --steps")
    args.stages = [s.strip() for s in args.stages.split(",")] if args.stages else list(STAGES)
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        ap.error(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    if not args.dry_run:
        from mtds.gpucheck.workloads import SPEED_MODELS
        if args.model not in SPEED_MODELS:
            ap.error(f"--model: choose from {', '.join(SPEED_MODELS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: torch sees no GPU", file=sys.stderr)
        return 2
    if device == "cpu" and not args.dry_run:
        print("error: the full run (gpt2-medium, s = 1024) is for a GPU; on CPU add --dry-run", file=sys.stderr)
        return 2
    plan = plan_for(args)
    out = args.out or os.environ.get("OUT") or "gpu_bench"
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    summary = os.path.join(out, "summary.md")
    budget = args.budget or (DRY_BUDGET_S if args.dry_run else BUDGET_S)
    bounds = {s: (DRY_BOUND_S if args.dry_run else BOUNDS[s]) for s in STAGES}
    started = time.monotonic()
    meta = {"command": sys.argv if argv is None else ["gpu_bench.py", *argv], "device": device,
            "plan": dataclasses.asdict(plan), "precision": PRECISION, "budget_s": budget, "bounds_s": bounds,
            "stages_asked": args.stages,
            "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}
    ctx = Context(plan, device, out)
    with open(summary, "w") as f:
        f.write(f"# gpu-bench {meta['started_utc']}{' (dry run)' if plan.dry_run else ''}\n\n"
                f"{plan.model}, s = {plan.seq}, {PRECISION}, (1,1,1), sizes {list(plan.sizes)}, {plan.steps} steps "
                f"({plan.warmup} warm-up) per run; budget {budget:.0f} s\n\n")
    _write(ctx, meta, None)
    failed = []
    for stage in args.stages:
        start = time.monotonic()
        left = budget - (start - started) - 5
        bound = min(bounds[stage], left)
        print(f"gpu-bench: {stage} (bound {max(bound, 0):.0f} s) ...", file=sys.stderr, flush=True)
        if bound < (1 if args.dry_run else MIN_STAGE_S):
            rec = {"error": f"skipped: {max(left, 0):.0f} s of the {budget:.0f} s budget left"}
            status = "skipped"
        else:
            try:
                rec = STAGE_FUNCS[stage](ctx, bound)
            except Exception as err:        # a bug in the stage itself: recorded, the run goes on
                from mtds.gpucheck.ranks import one_line
                rec = {"error": one_line(err)}
            status = "error" if rec.get("error") else "ok"
        rec.update(status=status, seconds=time.monotonic() - start, bound_s=max(bound, 0.0))
        ctx.stages[stage] = rec
        meta["elapsed_s"] = time.monotonic() - started
        _write(ctx, meta, stage)
        if status != "ok":
            failed.append(stage)
        why = f": {rec['error']}" if rec.get("error") else ""
        print(f"gpu-bench: {stage} {status} ({rec['seconds']:.0f} s){why}", file=sys.stderr, flush=True)
    with open(summary) as f:
        print(f.read(), flush=True)
    print(f"gpu-bench: {'every stage ran' if not failed else 'failed: ' + ', '.join(failed)}; "
          f"{time.monotonic() - started:.0f} s; results in {os.path.join(out, 'results.json')}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    from benchmarks import gpu_bench      # the ranks unpickle this module's functions by its importable name
    sys.exit(gpu_bench.main())
