#!/usr/bin/env python
"""mtds at (t,p,d) = (1,1,1) vs HuggingFace GPT2LMHeadModel + torch.optim.AdamW, then mtds layouts.

    python benchmarks/bench_vs_hf.py                      # issue shape: l=4 h=256 a=4 V=8192 s=256 b=4
    python benchmarks/bench_vs_hf.py --reps 3 --out runs/bench
    python benchmarks/bench_vs_hf.py --layers 2 --hidden 64 --seq 32 --reps 1 --steps 3 --warmup 1  # smoke

Part 1 — same model, data, optimizer and fp32 on both sides, each run in its own freshly spawned rank
(lab.testing.spawn), alternating HF / mtds / mtds / HF ... so drift in machine load hits both.
Goals: tokens/s >= 1.0x HF and peak RSS <= 1.1x HF. When a goal is missed the report says so and adds
a per-phase timing breakdown and a torch.profiler operator table of one step of each side.

Part 2 — (2,1,1), (1,2,1), (1,1,2) on CPU ranks: tokens/s relative to (1,1,1) at the same global batch,
and the bytes each rank communicated in the last step next to the formula (benchmarks/comm_formulas.py).
Writes bench.json and bench.md to --out (default runs/bench) and prints the markdown.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):      # run as a script: make `benchmarks` and `mtds` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.layouts import run_layouts          # noqa: E402
from lab.measure import median               # noqa: E402
from benchmarks.report import write                 # noqa: E402
from benchmarks.workloads import Shape              # noqa: E402

THROUGHPUT_GOAL, MEMORY_GOAL = 1.0, 1.1


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = Shape()
    ap.add_argument("--layers", type=int, default=s.layers)
    ap.add_argument("--hidden", type=int, default=s.hidden)
    ap.add_argument("--heads", type=int, default=s.heads)
    ap.add_argument("--vocab", type=int, default=s.vocab)
    ap.add_argument("--seq", type=int, default=s.seq)
    ap.add_argument("--micro-batch", type=int, default=s.micro_batch)
    ap.add_argument("--steps", type=int, default=8, help="steps per run, warm-up included [8]")
    ap.add_argument("--warmup", type=int, default=2, help="first steps not timed [2]")
    ap.add_argument("--reps", type=int, default=2, help="HF/mtds run pairs, alternated [2]")
    ap.add_argument("--layout-steps", type=int, default=4, help="steps per layout run (1 warm-up) [4]")
    ap.add_argument("--layouts", default="2,1,1 1,2,1 1,1,2",
                    help="space separated t,p,d triples ('' skips part 2) [2,1,1 1,2,1 1,1,2]")
    ap.add_argument("--profile", choices=("auto", "always", "never"), default="auto",
                    help="torch.profiler table of one step per side: auto = when a goal is missed [auto]")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per spawned run [900]")
    ap.add_argument("--out", default="runs/bench", help="output directory [runs/bench]")
    return ap.parse_args(argv)


def _one(side: str, shape: Shape, args, profile_step=None) -> dict:
    from lab.testing import spawn
    if side == "hf":
        from benchmarks.hf_side import train_hf
        return spawn(train_hf, 1, shape.as_dict(), args.steps, args.warmup, args.seed, profile_step,
                     timeout=args.timeout)[0]
    from benchmarks.mtds_side import train_mtds
    return spawn(train_mtds, 1, shape.as_dict(), 1, 1, shape.micro_batch, args.steps, args.warmup, args.seed,
                 None, profile_step, timeout=args.timeout)[0]


def _summarise(runs: list[dict]) -> dict:
    """Median over repetitions of throughput and memory; per-phase times of the median-throughput run."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    mid = ranked[len(ranked) // 2]
    return {
        "tokens_per_s": median([r["tokens_per_s"] for r in runs]),
        "tokens_per_s_each": [r["tokens_per_s"] for r in runs],
        "peak_rss_gib": median([r["peak_rss_gib"] for r in runs]),
        "peak_rss_gib_each": [r["peak_rss_gib"] for r in runs],
        "train_rss_gib": median([r["peak_rss_gib"] - r["rss_before_model_gib"] for r in runs]),
        "rss_before_model_gib": median([r["rss_before_model_gib"] for r in runs]),
        "phases_s": mid["phases_s"], "losses": mid["losses"], "parameters": mid["parameters"],
    }


def compare_with_hf(shape: Shape, args) -> dict:
    runs = {"hf": [], "mtds": []}
    for rep in range(args.reps):
        order = ("hf", "mtds") if rep % 2 == 0 else ("mtds", "hf")
        for side in order:
            run = _one(side, shape, args)
            runs[side].append(run)
            print(f"[bench] rep {rep + 1}/{args.reps} {side:4s}: {run['tokens_per_s']:,.0f} tokens/s, "
                  f"peak RSS {run['peak_rss_gib']:.3f} GiB", flush=True)
    hf, mt = _summarise(runs["hf"]), _summarise(runs["mtds"])
    goals = {
        "throughput_ratio": mt["tokens_per_s"] / hf["tokens_per_s"],
        "memory_ratio": mt["peak_rss_gib"] / hf["peak_rss_gib"],
        "train_memory_ratio": mt["train_rss_gib"] / hf["train_rss_gib"] if hf["train_rss_gib"] > 0 else float("nan"),
    }
    goals["throughput_met"] = goals["throughput_ratio"] >= THROUGHPUT_GOAL
    goals["memory_met"] = goals["memory_ratio"] <= MEMORY_GOAL
    return {"hf": hf, "mtds": mt, "goals": goals}


def verdict(goals: dict) -> str:
    parts = []
    for key, goal, word, sign in (("throughput", THROUGHPUT_GOAL, "tokens/s", ">="),
                                  ("memory", MEMORY_GOAL, "peak RSS", "<=")):
        ratio = goals[f"{key}_ratio"]
        state = "MET" if goals[f"{key}_met"] else "NOT MET"
        parts.append(f"{word}: mtds/HF = {ratio:.3f} (goal {sign} {goal}) -> {state}")
    if not (goals["throughput_met"] and goals["memory_met"]):
        parts.append("see the phase table (and operator profile) above for where the time / memory goes")
    return "**Verdict**: " + "; ".join(parts) + "."


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shape = Shape(args.layers, args.hidden, args.heads, args.vocab, args.seq, args.micro_batch)
    result = {"shape": shape.as_dict(), "steps": args.steps, "warmup": args.warmup, "reps": args.reps,
              **compare_with_hf(shape, args)}
    missed = not (result["goals"]["throughput_met"] and result["goals"]["memory_met"])
    if args.profile == "always" or (args.profile == "auto" and missed):
        # A separate run per side: profiling slows a step, so it never enters the timed numbers.
        step = min(args.warmup + 1, args.steps)
        result["profile"] = {side: _one(side, shape, args, profile_step=step)["profile_ops"] for side in ("hf", "mtds")}
    result["verdict"] = verdict(result["goals"])
    triples = [tuple(int(x) for x in t.split(",")) for t in args.layouts.split()]
    if triples:
        result["layouts"], result["notes"] = run_layouts(shape, triples, args)
    print(write(result, args.out), flush=True)
    print(f"[bench] wrote {os.path.join(args.out, 'bench.json')} and bench.md")


if __name__ == "__main__":
    main()
