"""Overhead of the collective tracer (mtds.observe.comm_trace) per collective call.

    python benchmarks/bench_comm_trace.py [--world 1 [2]] [--calls 2000] [--repeats 30] [--out DIR]

On a gloo world of --world ranks (new processes, CPU), every rank times rounds of --calls back-to-back calls
of the smallest collectives there are (a one-element all_reduce, and a broadcast from rank 0) three ways,
interleaved over --repeats rounds (the order of the three rotating) so that drifts in machine load hit all
three alike:
  off       torch's own function, the reference taken before the tracer wrapped it
  idle      the tracer's wrapper with no tracer counting (what stays installed after ``uninstall``)
  counting  the wrapper with one tracer counting (every training run: TrainConfig.trace_comm is on by default)
It reports the fastest round's microseconds per call of each (rank 0's; every rank runs the same loop;
the fastest round is the one other processes disturbed least) and the tracer's cost, counting - off.
On such tiny collectives that cost is the largest share of a call it can ever be. The check at the end
(the tracer counted every call it saw, at the right bytes) keeps a broken tracer from looking cheap.
Writes OUT/bench_comm_trace.json and OUT/bench_comm_trace.md (--out given).
"""
import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("off", "idle", "counting")
KINDS = ("all_reduce", "broadcast")


def _loop(fn, kind: str, x, calls: int) -> float:
    """Seconds per call of ``calls`` calls of ``fn`` (started together on every rank)."""
    import torch.distributed as dist
    dist.barrier()
    start = time.perf_counter()
    if kind == "all_reduce":
        for _ in range(calls):
            fn(x)
    else:
        for _ in range(calls):
            fn(x, src=0)
    return (time.perf_counter() - start) / calls


def time_rank(calls: int, repeats: int) -> dict:
    """Runs on every rank: {kind: {way: [s per call, one per repeat]}} and what the tracer counted."""
    import torch
    import torch.distributed as dist

    from mtds.observe.comm_trace import CommTracer
    originals = {kind: getattr(dist, kind) for kind in KINDS}
    if any(hasattr(f, "_mtds_tracers") for f in originals.values()):
        raise RuntimeError("torch.distributed is already wrapped in this process: run on fresh ranks")
    tracer = CommTracer()
    tracer.install()
    tracer.uninstall()            # the wrappers stay, nothing counts
    wrapped = {kind: getattr(dist, kind) for kind in KINDS}
    x = torch.ones(1)
    times = {kind: {way: [] for way in WAYS} for kind in KINDS}
    counting = CommTracer()
    for round_ in range(repeats):
        for kind in KINDS:
            for way in WAYS[round_ % 3:] + WAYS[:round_ % 3]:
                if way == "counting":
                    counting.install()
                times[kind][way].append(_loop(originals[kind] if way == "off" else wrapped[kind], kind, x, calls))
                counting.uninstall()
    return {"times": times, "summary": counting.summary(), "world": dist.get_world_size()}


def check_counts(result: dict, calls: int, repeats: int) -> None:
    """The counting tracer saw every call with 4 bytes each (a group of one is not counted at all; the
    barriers that start each loop are left out)."""
    summary, world = result["summary"], result["world"]
    expected = {} if world == 1 else {f"{kind}/world": {"calls": calls * repeats, "bytes": 4 * calls * repeats}
                                      for kind in KINDS}
    found = {key: {"calls": v["calls"], "bytes": v["bytes"]} for key, v in summary.items()
             if not key.startswith("barrier/")}
    if found != expected:
        raise AssertionError(f"the tracer counted {found}, expected {expected}")


def measure(world: int, calls: int, repeats: int) -> dict:
    """{kind: {way: fastest round's µs per call, "overhead_us": counting - off}} on rank 0 of a fresh world."""
    from benchmarks.bench_comm_trace import time_rank as body   # by module name: a script's __main__ is not
    from lab.testing import spawn                                 # importable in the ranks
    results = spawn(body, world, calls, repeats, timeout=600, fresh=True)
    for result in results:
        check_counts(result, calls, repeats)
    out = {}
    for kind in KINDS:
        med = {way: min(results[0]["times"][kind][way]) * 1e6 for way in WAYS}
        out[kind] = {**{f"{way}_us": round(v, 3) for way, v in med.items()},
                     "overhead_us": round(med["counting"] - med["off"], 3),
                     "idle_overhead_us": round(med["idle"] - med["off"], 3)}
    return out


def table(rows: dict) -> str:
    lines = ["| world | collective | off µs/call | idle wrapper µs/call | counting µs/call | tracer cost µs/call |",
             "|---|---|---|---|---|---|"]
    for world, kinds in rows.items():
        for kind, r in kinds.items():
            lines.append(f"| {world} | {kind} | {r['off_us']:.2f} | {r['idle_us']:.2f} | {r['counting_us']:.2f} | "
                         f"{r['overhead_us']:+.2f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # A world of 2 on a machine without two free cores times the scheduler, not the tracer (docs/benchmarks.md).
    parser.add_argument("--world", type=int, nargs="+", default=[1])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.calls < 1 or args.repeats < 1 or any(w < 1 for w in args.world):
        print("error: --calls, --repeats and every --world must be positive", file=sys.stderr)
        raise SystemExit(2)
    rows = {world: measure(world, args.calls, args.repeats) for world in args.world}
    text = table(rows)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_comm_trace.json"), "w") as f:
            json.dump({"calls": args.calls, "repeats": args.repeats, "rows": rows}, f, indent=2)
        with open(os.path.join(args.out, "bench_comm_trace.md"), "w") as f:
            f.write(text + "\n")
    return rows


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
