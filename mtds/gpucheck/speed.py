"""The speed table: mtds at (t,p,d) = (1,1,1) against HuggingFace ``GPT2LMHeadModel`` + torch AdamW (fused
on CUDA) on identical work -- the same model and initial weights, batches, micro-batch, steps, clipping
and precision (HF: fp32 weights under bf16/fp16 autocast, as the HF Trainer runs; mtds: DeepSpeed's
16-bit training with fp32 master weights) -- then mtds on every rank at once. tokens/s from the median
step after warm-up; model and hardware TFLOP/s and MFU from mtds.observe.metrics (the counts and peak tables
train.py logs with); peak memory allocated and reserved by the CUDA caching allocator (on CPU the
process's peak RSS, which in a reused rank includes earlier work). The CLI ends each speed section with
the largest micro-batch that fits (:mod:`mtds.gpucheck.microbatch`, GPUs)."""
from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time

from mtds.gpucheck.report import Section

GOAL_SPEEDUP, GOAL_MFU = 1.0, 0.45      # the GPU checklist's goals: reported beside the numbers, not enforced


def _peak_memory(device) -> dict:
    from mtds.training.distributed import peak_memory_gib
    allocated, reserved = peak_memory_gib(device)
    return {"allocated_gib": allocated, "reserved_gib": reserved}


def _reset_peak(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _hf_side(workload, precision: str, warmup: int) -> dict:
    import torch
    import torch.nn.functional as F

    from mtds.data import MicroBatchStream, build_packed_dataset, load_tokenizer

    from mtds.gpucheck import ds_configs as C
    from mtds.gpucheck.reference import hf_model
    from mtds.training.distributed import group_device
    device = group_device()
    _reset_peak(device)
    model = hf_model(workload.model, device).train()
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=C.LR, betas=C.BETAS, eps=C.EPS, weight_decay=C.WEIGHT_DECAY,
                            **fused)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 8) if precision == "fp16" else None
    dataset = build_packed_dataset(None, load_tokenizer(None), workload.seq, show_progress=False)
    B, b = workload.global_batch, workload.micro_batch
    stream = MicroBatchStream(dataset, global_batch_size=B, micro_batch_size=b, seed=C.SEED)
    times, losses = [], []
    for _ in range(workload.steps):
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for _ in range(B // b):
            input_ids, labels = (t.to(device, non_blocking=True) for t in next(stream))
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                logits = model(input_ids=input_ids).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / (B // b)
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.detach()
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), C.CLIP)
        (scaler.step(opt), scaler.update()) if scaler else opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))             # synchronises: the step is done
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[warmup:]), "first_loss": losses[0], "losses": losses,
            **_peak_memory(device)}


def _mtds_side(workload, precision: str, warmup: int, layout: tuple[int, int, int], log: str,
               compile: bool = False, profile: bool = True) -> dict:
    import torch.distributed as dist

    from mtds.training import run

    from mtds.gpucheck.ds_configs import train_config
    from mtds.training.distributed import group_device
    device = group_device()
    _reset_peak(device)
    t, p, d = layout
    # the last warm-up step (not timed) of the eager (1,1,1) run is profiled: where its time goes
    step = warmup if profile and layout == (1, 1, 1) and not compile and warmup >= 1 else None
    cfg = train_config(workload, precision, device.type, tp=t, pp=p, dp=d, log_jsonl=log, compile=compile,
                       profile_step=step)
    result = run(cfg)
    dist.barrier()                  # the log is written by the reporting rank only; every rank reads it
    with open(log) as f:
        records = [r for r in map(json.loads, f) if r.get("kind") == "train"]
    step_s = statistics.median(r["step_time_s"] for r in records[warmup:]) if records else None
    return {"step_s": step_s, "first_loss": result.losses[0], "losses": result.losses, "profile": result.profile,
            **_peak_memory(device)}


def _case(case):
    side, workload, precision, warmup, layout, log = case
    if side == "hf":
        return _hf_side(workload, precision, warmup)
    return _mtds_side(workload, precision, warmup, layout, log, compile=side == "mtds-compile")


def spread_layout(ranks: int) -> tuple[int, int, int] | None:
    """mtds on every rank: t = 2, then p = 2 from four ranks, data parallel for the rest (one node's
    NVLink holds the tensor-parallel pair); None on one rank."""
    if ranks < 2:
        return None
    t = 2
    p = 2 if ranks >= 4 else 1
    return (t, p, ranks // (t * p)) if ranks % (t * p) == 0 else (1, 1, ranks)


def workload_for(workload, layout: tuple[int, int, int]):
    """The per-replica batch of a layout: the same micro-batch; with a pipeline m = 4p micro-batches per step
    (1F1B's bubble (p-1)/(m+p-1) under 1/5) instead of (1,1,1)'s; each data-parallel replica adds its own."""
    from dataclasses import replace
    p = layout[1]
    return workload if p == 1 else replace(workload, global_batch=workload.micro_batch * 4 * p)


def profile_lines(name: str, summary: dict, step: int) -> list[str]:
    """The step profile (mtds.observe.step_profile) of one run under a heading: where its time went."""
    from mtds.observe.step_profile import markdown_table
    what = "kernels" if summary["device"] == "cuda" else "operators"
    return [f"Where step {step} of {name} went (torch.profiler; {summary['device']} {what}' own time, "
            f"{summary['launches']:,} {what}, {summary['busy_ms']:.1f} ms busy of {summary['wall_ms']:.1f} ms "
            f"wall, profiled so slower than the timed steps):", "", *markdown_table(summary), ""]


def _row(name, value, workload, precision, machine, world, global_batch) -> dict:
    from mtds.observe.metrics import model_config_flops, peak_tflops
    tokens = global_batch * workload.seq
    model_tf = model_config_flops(workload.model, global_batch, workload.seq) / value["step_s"] / world / 1e12
    hw_tf = model_config_flops(workload.model, global_batch, workload.seq, recompute="none") / value["step_s"] / world / 1e12
    peak = peak_tflops(machine.name, precision) if machine.cuda else None
    reserved = value["reserved_gib"]
    return {"run": name, "tokens/s": f"{tokens / value['step_s']:,.0f}", "step s": f"{value['step_s']:.4f}",
            "model TFLOP/s per rank": f"{model_tf:.3g}", "hw TFLOP/s per rank": f"{hw_tf:.3g}",
            "MFU": f"{model_tf / peak:.1%}" if peak else "n/a (no peak for this device)",
            "peak allocated GiB (CPU: RSS)": f"{value['allocated_gib']:.2f}",
            "peak mem reserved GiB": f"{reserved:.2f}" if reserved is not None else "n/a (CPU)"}


def check(machine, workload, precision: str, warmup: int, timeout: float, title: str = "speed") -> Section:
    from mtds.gpucheck.parity import TOLERANCE
    from mtds.gpucheck.ranks import run_cases
    from mtds.gpucheck.reference import max_rel_diff
    section = Section(title, f"{workload.describe()}, {precision}, {warmup} warm-up step(s) not timed. "
                      f"Goals (reported, not enforced): mtds >= {GOAL_SPEEDUP:g}x HF tokens/s at (1,1,1), "
                      f"MFU >= {GOAL_MFU:.0%}. A run fails if it crashes, times out, or its first-step loss "
                      f"differs from the other side's (identical work).")
    runs = [("HF GPT2LMHeadModel + AdamW" + (" (fused)" if machine.cuda else ""), "hf", (1, 1, 1)),
            ("mtds (1,1,1)", "mtds", (1, 1, 1))]
    if machine.cuda:        # what --compile buys on this GPU (Inductor's Triton kernels); CPU compiles are slow
        runs.append(("mtds (1,1,1) --compile", "mtds-compile", (1, 1, 1)))
    spread = spread_layout(machine.ranks) if machine.cuda else None    # two CPU ranks say nothing about scaling
    if spread:
        runs.append((f"mtds ({','.join(map(str, spread))}) on {machine.ranks} ranks", "mtds", spread))
    values = {}
    logs = tempfile.mkdtemp(prefix="mtds-gpucheck-speed-")
    for i, (name, side, layout) in enumerate(runs):
        world = layout[0] * layout[1] * layout[2]
        run_workload = workload_for(workload, layout)
        case = (side, run_workload, precision, warmup, layout, os.path.join(logs, f"run{i}.jsonl"))
        outcome, _ = run_cases(machine, world, _case, [case], timeout=timeout)
        section.seconds += outcome.seconds
        if outcome.error or not outcome.cases[0][0]:
            section.fail(name, outcome.error or outcome.cases[0][1])
            continue
        value = outcome.cases[0][1]
        good = value["step_s"] is not None and all(math.isfinite(x) for x in value["losses"])
        if not good:
            section.fail(name, "no step time or a non-finite loss")
            continue
        values[name] = value
        if value.get("profile"):
            section.extra += profile_lines(name, value["profile"], warmup)
        global_batch = run_workload.global_batch * layout[2]
        row = _row(name, value, run_workload, precision, machine, world, global_batch)
        section.table = (section.table or []) + [row]
        ref = values.get(runs[0][0])
        if side.startswith("mtds") and ref is not None and layout == (1, 1, 1):
            diff = max_rel_diff([value["first_loss"]], [ref["first_loss"]])
            tol = TOLERANCE[precision].loss
            speedup = ref["step_s"] / value["step_s"]
            section.add(name, diff <= tol, f"{row['tokens/s']} tokens/s = {speedup:.2f}x HF, MFU {row['MFU']}; first "
                        f"loss {value['first_loss']:.5f} vs HF {ref['first_loss']:.5f}",
                        f"first-step loss differs from HF's by {diff:.1e} > {tol:g}: not the same work")
        else:
            section.add(name, True, f"{row['tokens/s']} tokens/s, MFU {row['MFU']}")
    return section
