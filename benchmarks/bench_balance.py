"""Stage balance measured: --pipeline-balance uniform against cost (and any --layouts) at one schedule.

    OMP_NUM_THREADS=1 python benchmarks/bench_balance.py [--p 2] [--m 8] [--steps 6] [--repeats 2]

Same model and launch as benchmarks/bench_schedules.py (gpt2-tiny widened to --hidden, --blocks blocks,
seq 128, micro batch 2, fp32 ZeRO-1, train.py under torchrun with --timeline). The cases run alternately
(A B A B ...) so that both see the same machine load. Per case: the median and the best (fastest) of
the steps 2..N of all repeats -- on a shared machine other jobs only ever add time, so the best step is
the least disturbed -- of the step time, tokens/s and each rank's bubble (idle / step time, the step
log's); the critical (slowest-computing) rank's bubble; each rank's compute per micro-batch (F + B + W
from each repeat's last-step trace / m, the smallest over repeats). Writes a markdown table (stdout and OUT/balance_p{p}_m{m}.md) and the
Gantt PNG of each case's least disturbed repeat (OUT/balance_{case}_p{p}_m{m}.png).
"""
import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_schedules import launch, small_png, theory, write_model  # noqa: E402


def compute_per_rank(trace_path: str) -> dict[int, float]:
    """Seconds inside F/B/W per rank in the traced step (mtds.observe.timeline.compute_time on the trace)."""
    from mtds.observe.timeline import TimelineEvent, compute_time
    with open(trace_path) as f:
        trace = json.load(f)["traceEvents"]
    events = [TimelineEvent(e["pid"], e["cat"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
              for e in trace if e.get("ph") == "X"]
    return {rank: compute_time(events, rank) for rank in sorted({e.rank for e in events})}


def layout_line(stdout_path: str) -> str:
    with open(stdout_path) as f:
        return next((line.split("pipeline layout ", 1)[1].split(" (")[0] for line in f if "pipeline layout " in line), "?")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=int, default=2)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, help="transformer blocks [4p]")
    ap.add_argument("--layouts", nargs="*", default=[], help="explicit --pipeline-layout cases besides the two balances")
    ap.add_argument("--out", default="docs/pipeline")
    ap.add_argument("--work", default="runs/bench_balance")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    model = write_model(os.path.join(args.work, "model"), args.blocks or 4 * args.p, args.hidden)
    cases = [("uniform", ("--pipeline-balance", "uniform")), ("cost", ("--pipeline-balance", "cost"))]
    cases += [(f"layout{k}", ("--pipeline-layout", text)) for k, text in enumerate(args.layouts)]
    v = 2 if args.schedule == "interleaved" else 1
    runs = {name: [] for name, _ in cases}
    started = time.monotonic()
    for rep in range(args.repeats):
        for name, extra in cases:
            run = launch(args, args.schedule, v, args.m, model, args.work, extra=extra, tag=f"_{name}_{rep}")
            if "error" in run:
                sys.exit(f"{name}: {run['error']}")
            run["compute"] = compute_per_rank(run["trace"])
            run["layout"] = layout_line(run["stdout"])
            runs[name].append(run)
            print(f"{name} repeat {rep}: {run['layout']}, step "
                  f"{statistics.median(r['step_time_s'] for r in run['steps']):.3f} s ({run['wall_s']:.0f} s)", flush=True)
    t_max, _, _ = theory(args.schedule, args.p, v, args.m)
    rows = ["| balance | layout | step s median (best) | tokens/s median (best) | bubble per rank, best step "
            "| critical rank: bubble, best step (theory) | compute per micro-batch per rank, s |",
            "|---|---|---|---|---|---|---|"]
    for name, _ in cases:
        steps = [r for run in runs[name] for r in run["steps"]]
        best = min(steps, key=lambda r: r["step_time_s"])
        step_s = statistics.median(r["step_time_s"] for r in steps)
        tokens = statistics.median(r["tokens_per_s"] for r in steps)
        compute = [min(run["compute"][s] for run in runs[name]) / args.m for s in range(args.p)]
        critical = max(range(args.p), key=lambda s: compute[s])
        per_rank = best["bubble_per_stage"]
        rows.append(f"| {name} | `{runs[name][-1]['layout']}` | {step_s:.3f} ({best['step_time_s']:.3f}) | "
                    f"{tokens:,.0f} ({best['tokens_per_s']:,.0f}) | {' / '.join(f'{b:.0%}' for b in per_rank)} | "
                    f"rank {critical}: {per_rank[critical]:.1%} ({t_max:.1%}) | "
                    f"{' / '.join(f'{c:.3f}' for c in compute)} |")
        fastest = min(runs[name], key=lambda run: min(r["step_time_s"] for r in run["steps"]))
        small_png(fastest["png"], os.path.join(args.out, f"balance_{name}_p{args.p}_m{args.m}.png"))
    table = "\n".join(rows) + "\n"
    path = os.path.join(args.out, f"balance_p{args.p}_m{args.m}.md")
    with open(path, "w") as f:
        f.write(table)
    print(f"\n{table}\ntable: {path}; {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
