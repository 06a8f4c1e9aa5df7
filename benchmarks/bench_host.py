#!/usr/bin/env python
"""Host time per step at a tiny, dispatch-bound shape: mtds (1,1,1) next to HF GPT2LMHeadModel + fused AdamW and
Megatron-core GPT, each on one process (issue 35).

    python benchmarks/bench_host.py                                   # l=8 h=64 a=4 V=8192 s=64 b=1, 5 x 30 steps
    python benchmarks/bench_host.py --out runs/host.jsonl             # also every run (and the summary) as JSON lines
    python benchmarks/bench_host.py --reps 1 --steps 6 --warmup 2     # smoke

At this shape a step's arithmetic is a few hundred MFLOP, most of it in the vocabulary head, while each side
dispatches on the order of a thousand operators in the forward, backward and optimizer step: the step's time
is mostly host work (Python and operator dispatch), so this compares framework overhead. The "arithmetic
floor" printed above the table (model FLOPs / this core's large-GEMM peak) bounds the part that is not.

Sides, one rank each (t = p = d = 1, gloo), fp32, GPT-2 architecture (tied embeddings, gelu_new, learned
positions), no dropout, AdamW(1e-3, (0.9, 0.95), 1e-8, wd 0.1), gradient clipping 1.0, constant learning rate,
OMP_NUM_THREADS (default 1) threads:

* hf       -- benchmarks/hf_side.py: GPT2LMHeadModel, cross entropy, backward, clip_grad_norm_,
              torch.optim.AdamW(fused=True), zero_grad, loss.item(); a step is that whole body.
* mtds     -- benchmarks/mtds_steps.py train_shape: ``mtds.training.job.run``, the real DeepSpeed engine; a step
              is a whole loop iteration, hooks (logging, non-finite check, signals) included. mtds runs
              torch's fused AdamW on CPU itself (mtds/training/ds_config.py).
* megatron -- ../shared/tools/peers/bench_peer.py --peer megatron --model gpt2 in the peers' interpreter
              (benchmarks/peer_runner.py): GPTModel (local spec), DDP, get_megatron_optimizer,
              get_forward_backward_func; a step is its loop body. Megatron-core without apex / Transformer
              Engine falls back to torch.optim.AdamW with torch's default kernel (no fused option reaches
              it): the peer runs as its tool runs it. Where the peers are not installed the side is skipped,
              saying why, and the other two run. Its data are random tokens (the same shapes).

Each repetition runs every side once in a fresh process, the order rotated by one each repetition (hf, mtds,
megatron; then mtds, megatron, hf; ...) so drift in machine load hits every side.

Formulas (b micro-batch, s sequence; steps warmup+1..steps of a run are timed):
  run step time       = median over the timed steps of one step's wall time
                        (on CPU the host does all the work: a step's wall time is its host time)
  median step (side)  = median over repetitions of the run step times
  tokens/s            = b * s / median step
  ops / step          = ATen operators dispatched in one more step after the timed ones (not timed: counted
                        by lab.testing.op_counts.OpCounts, a TorchDispatchMode; hf and mtds sides only)
  us / op             = median step / ops per step
  mtds / best         = mtds median step / min(other sides' median step): <= 1.0 means mtds is no slower
                        than the best (goal of issue 35)
  paired ratio (rep)  = mtds run step time / min(other sides' run step times) of the same repetition
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):      # run as a script: make `benchmarks`, `lab` and `mtds` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.peer_runner import peer_missing, run_peer    # noqa: E402
from benchmarks.workloads import Shape                       # noqa: E402
from lab.measure import median                               # noqa: E402

GOAL = 1.0
SIDES = ("hf", "mtds", "megatron")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=8192, help="small, so the head does not dominate [8192]")
    ap.add_argument("--reps", type=int, default=5, help="repetitions, each side once per repetition [5]")
    ap.add_argument("--steps", type=int, default=30, help="steps per run, warm-up included [30]")
    ap.add_argument("--warmup", type=int, default=5, help="first steps not timed [5]")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run [900]")
    ap.add_argument("--out", default=None, help="append every run and the summary as JSON lines to this file")
    a = ap.parse_args(argv)
    if not 0 <= a.warmup < a.steps or a.reps < 1:
        ap.error("--warmup must be in 0 .. --steps - 1, and --reps at least 1")
    return a


def _ops(counts: dict | None) -> dict:
    if not counts:
        return {}
    # the fused kernel is one ATen call per step; seeing it confirms the side ran the fused AdamW
    return {"ops_per_step": sum(counts.values()),
            "fused_adamw": any("_fused_adamw" in name for name in counts)}


def run_side(side: str, shape: Shape, a) -> dict:
    """One run of ``side`` in fresh processes: step times, the run's step time, operator count (hf, mtds)."""
    from lab.testing import spawn
    ops_step = a.steps + 1      # one step more than timed, run under the operator counter
    if side == "hf":
        from benchmarks.hf_side import train_hf
        # spawn passes positional arguments only: ..., profile_step None, fused True, ops_step
        r = spawn(train_hf, 1, shape.as_dict(), ops_step, a.warmup, a.seed, None, True, ops_step,
                  timeout=a.timeout, fresh=True)[0]
        times, counts, params = r["step_times_s"], r["op_counts"], r["parameters"]
    elif side == "mtds":
        from benchmarks.mtds_steps import train_shape
        r = spawn(train_shape, 1, shape.as_dict(), ops_step, a.seed, ops_step, timeout=a.timeout, fresh=True)[0]
        times, counts, params = r["times"], r["op_counts"], r["parameters"]
    else:
        r = run_peer("megatron", "gpt2", 1, 1, 1, a.steps, a.warmup, threads=int(os.environ["OMP_NUM_THREADS"]),
                     timeout=a.timeout, shape=shape.as_dict())
        if "error" in r:
            return {"side": side, "error": r["error"]}
        # its own median over the same steps; step_times_s are rounded to 0.1 ms for reading
        return {"side": side, "step_s": r["median_step_s"], "step_times_s": r["step_times_s"],
                "losses": r["losses"], "parameters": r.get("params_per_rank"), "version": r.get("version"),
                "patches": r.get("patches")}
    return {"side": side, "step_s": median(times[a.warmup:a.steps]), "parameters": params,
            "step_times_s": [round(t, 5) for t in times[:a.steps]],
            "losses": [round(x, 5) for x in r["losses"][:a.steps]], **_ops(counts)}


def summarise(runs: list[dict], sides: list[str], shape: Shape) -> dict:
    ok = [r for r in runs if "step_s" in r]
    by_side = {s: [r for r in ok if r["side"] == s] for s in sides}
    out = {"sides": {}, "errors": {}}
    for s, mine in by_side.items():
        if not mine:     # every run of the side failed: the table says why
            out["errors"][s] = next(r["error"] for r in runs if r["side"] == s)
            continue
        step = median([r["step_s"] for r in mine])
        counted = [r["ops_per_step"] for r in mine if "ops_per_step" in r]
        ops = median(counted) if counted else None
        out["sides"][s] = {"median_step_ms": step * 1e3, "tokens_per_s": shape.tokens_per_micro_batch / step,
                           "run_step_ms": [r["step_s"] * 1e3 for r in mine], "ops_per_step": ops,
                           "us_per_op": step * 1e6 / ops if ops else None,
                           "fused_adamw": mine[0].get("fused_adamw"), "parameters": mine[0].get("parameters")}
    others = [s for s in out["sides"] if s != "mtds"]
    if "mtds" in out["sides"] and others:
        best = min(others, key=lambda s: out["sides"][s]["median_step_ms"])
        ratio = out["sides"]["mtds"]["median_step_ms"] / out["sides"][best]["median_step_ms"]
        # each repetition's sides ran back to back, under the same load
        paired = []
        for rep in sorted({r["rep"] for r in ok}):
            here = {r["side"]: r["step_s"] for r in ok if r["rep"] == rep}
            rest = [t for s, t in here.items() if s != "mtds"]
            if "mtds" in here and rest:
                paired.append(here["mtds"] / min(rest))
        out.update(best_other=best, ratio=ratio, paired_ratios=paired, goal_met=ratio <= GOAL)
    return out


def table(summary: dict, skipped: dict, floor_ms: float) -> str:
    header = ("| side | median step = host time (ms) | tokens/s | ATen ops / step | us / op | fused AdamW | parameters "
              "| run step times (ms) |")
    lines = [f"arithmetic floor (model FLOPs / one core's fp32 GEMM peak): {floor_ms:.2f} ms a step", "",
             header, "|---|---:|---:|---:|---:|---|---:|---|"]
    for s, r in summary["sides"].items():
        ops = f"{r['ops_per_step']:,.0f}" if r["ops_per_step"] else "-"
        per_op = f"{r['us_per_op']:.1f}" if r["us_per_op"] else "-"
        fused = {True: "yes", False: "no", None: "-"}[r["fused_adamw"]]
        params = f"{r['parameters']:,}" if r["parameters"] else "-"
        lines.append(f"| {s} | {r['median_step_ms']:.2f} | {r['tokens_per_s']:,.0f} | {ops} | {per_op} | {fused} | "
                     f"{params} | " + ", ".join(f"{t:.2f}" for t in r["run_step_ms"]) + " |")
    for s, why in skipped.items():
        lines.append(f"| {s} | skipped: {why} | | | | | | |")
    for s, err in summary["errors"].items():
        lines.append(f"| {s} | failed: {str(err)[:200]} | | | | | | |")
    if "ratio" in summary:
        state = "MET" if summary["goal_met"] else "NOT MET"
        lines += ["", f"**mtds / best other ({summary['best_other']})**: {summary['ratio']:.3f} "
                  f"(goal <= {GOAL}: {state}); paired per repetition: "
                  + ", ".join(f"{x:.3f}" for x in summary["paired_ratios"])]
    return "\n".join(lines)


def arithmetic_floor_s(shape: Shape) -> float:
    from mtds.observe.gemm_peak import cpu_gemm_peak
    from mtds.observe.metrics import model_config_flops
    return model_config_flops(shape.model_config(), shape.micro_batch, shape.seq) / cpu_gemm_peak()


def main(argv=None) -> None:
    a = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shape = Shape(a.layers, a.hidden, a.heads, a.vocab, a.seq, a.micro_batch)
    skipped = {}
    why = peer_missing("megatron")
    if why:
        skipped["megatron"] = why
        print(f"[skip] megatron: {why}", flush=True)
    sides = [s for s in SIDES if s not in skipped]
    print(f"[host] shape {shape.as_dict()}, {a.reps} reps x {a.steps} steps ({a.warmup} warm-up), "
          f"{os.environ['OMP_NUM_THREADS']} thread(s); load average {os.getloadavg()[0]:.2f}", flush=True)
    runs = []
    for rep in range(a.reps):
        k = rep % len(sides)
        for side in sides[k:] + sides[:k]:
            t0 = time.time()
            r = run_side(side, shape, a)
            r.update(rep=rep, wall_s=round(time.time() - t0, 1), load=round(os.getloadavg()[0], 2))
            runs.append(r)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps({"shape": shape.as_dict(), **r}) + "\n")
            print(f"[rep {rep + 1}/{a.reps}] {side:8s} " + (f"{r['step_s'] * 1e3:8.2f} ms/step" if "step_s" in r
                  else f"ERROR {str(r['error'])[:300]}") + f"  (run {r['wall_s']} s, load {r['load']})", flush=True)
    summary = summarise(runs, sides, shape)
    floor = arithmetic_floor_s(shape)
    summary.update(shape=shape.as_dict(), reps=a.reps, steps=a.steps, warmup=a.warmup, skipped=skipped,
                   arithmetic_floor_ms=floor * 1e3)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps({"summary": summary}) + "\n")
    print("\n" + table(summary, skipped, floor * 1e3), flush=True)


if __name__ == "__main__":
    main()
