"""Context parallelism under a memory cap: the longest sequence each C trains with a tiny model when a rank's
memory may grow by at most --cap-gib over what the same run needs at a short sequence.

    python benchmarks/bench_cp_memory.py [--cap-gib 0.5] [--cp 1 2 4] [--comm a2a] [--start 1024]

For each C: train.py on C ranks (t = p = d = 1), the Llama-style model of benchmarks/bench_cp.py, one
sequence per step, fp32, 2 steps, first at --base-seq (the baseline: libraries, weights, optimizer state),
then at --start, 2 --start, 4 --start ... until a run's growth passes the cap (or --max-seq). A rank's
memory is its peak resident set (the step log's ``peak_mem_gib``: ``ru_maxrss`` on CPU, the high-water mark
of the process); growth(s) = peak(s) - peak(base-seq). What grows with s is each rank's s/C tokens: their
activations (2·layers blocks' saved tensors), the [s/C, V] logits of the loss and the attention's working
set, so the longest sequence under the cap should grow about C-fold (the claim of docs/long_context.md).
The doubling grid resolves it to a factor of 2. Each run is a fresh launch of train.py (a fresh high-water
mark).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def peak_gib(seq: int, c: int, args, work: str) -> float | str:
    """The highest ``peak_mem_gib`` any step of the run logged (the reporting rank's), or the error."""
    from benchmarks.bench_cp import train_command
    from benchmarks.bench_schedules import run_train
    case = os.path.join(work, f"s{seq}_c{c}")
    cmd, jsonl = train_command(case, seq, c, args.comm, 2, args.hidden, args.layers,
                               positions=max(seq, args.base_seq))
    error = run_train(cmd, case)
    if error:
        return error
    with open(jsonl) as f:
        return max(r["peak_mem_gib"] for r in map(json.loads, f) if r.get("peak_mem_gib") is not None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap-gib", type=float, default=0.5, help="growth allowed over the short run [0.5]")
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--comm", default="a2a", choices=("a2a", "p2p"), help="[a2a: the faster on CPU]")
    ap.add_argument("--base-seq", type=int, default=256)
    ap.add_argument("--start", type=int, default=1024)
    ap.add_argument("--max-seq", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)
    from benchmarks.bench_cp import write_table
    work = tempfile.mkdtemp(prefix="mtds-bench-cp-memory-")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = [f"| C | base peak GiB (seq {args.base_seq}) | growth GiB per seq | longest seq under "
            f"+{args.cap_gib} GiB | vs C = {args.cp[0]} |", "|---|---:|---|---:|---:|"]
    longest = {}
    for c in args.cp:
        base = peak_gib(args.base_seq, c, args, work)
        if isinstance(base, str):
            rows.append(f"| {c} | {base} | | | |")
            continue
        seen, seq, best = [], args.start, None
        while seq <= args.max_seq:
            peak = peak_gib(seq, c, args, work)
            if isinstance(peak, str):
                seen.append(f"{seq}: {peak}")
                break
            seen.append(f"{seq}: {peak - base:.2f}")
            print(f"C={c} seq={seq}: peak {peak:.2f} GiB, growth {peak - base:.2f}", flush=True)
            if peak - base > args.cap_gib:
                break
            best, seq = seq, seq * 2
        longest[c] = best
        ratio = f"{best / longest[args.cp[0]]:.0f}x" if best and longest.get(args.cp[0]) else "-"
        rows.append(f"| {c} | {base:.2f} | {', '.join(seen)} | {best or '-'} | {ratio} |")
    write_table(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
