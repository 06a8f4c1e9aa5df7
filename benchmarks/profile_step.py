#!/usr/bin/env python
"""One profiled step of mtds next to the same step of its peer (issue 21): where does mtds spend more?

    python benchmarks/profile_step.py --model gpt2 --tp 1          # mtds vs Megatron-core, GPT-2, tp=1
    python benchmarks/profile_step.py --model llama --tp 2         # mtds vs torchtitan, Llama, tp=2
    python benchmarks/profile_step.py --model gpt2 --tp 1 --no-peer

Each side runs ``--steps`` steps of the peer work (benchmarks/peer_work.py) and profiles step
``--profile-step`` with torch.profiler (CPU) on every rank; rank 0's tables are printed: mtds's own
``record_function`` ranges (mtds.forward / backward / optimizer / hook.*, mtds.layer) and, for both
sides, the operators with the most self time, side by side. Profiling slows a step: the timed numbers
come from benchmarks/bench_peers.py, not from here.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import peer_work                             # noqa: E402
from benchmarks.peer_runner import peer_missing, run_peer    # noqa: E402


def profile_mtds(model: str, tp: int, pp: int, microbatches: int, steps: int, step: int,
                 overrides: dict | None = None, cpu_step: int | None = None) -> dict:
    from benchmarks.mtds_steps import train_mtds
    from lab.testing import spawn
    workdir = tempfile.mkdtemp(prefix="mtds_profile_")
    return spawn(train_mtds, tp * pp, model, tp, pp, microbatches, steps, 1, step, workdir, overrides, cpu_step,
                 timeout=900)[0]


def thread_cpu_table(m: dict, cpu_step: int, top: int) -> str:
    """Rank 0's thread CPU per ATen call (operator and input shapes) in step ``cpu_step``, against the
    thread CPU of the steps without the counter: the rest is Python and host work between the calls."""
    rows, plain = m["op_cpu"], [c for i, c in enumerate(m["thread_cpu"], 1) if i not in (1, cpu_step)]
    ops = sum(r["ms"] for r in rows)
    step = sorted(plain)[len(plain) // 2] * 1e3
    gemm = sum(r["ms"] for r in rows if r["op"] in ("mm", "addmm", "bmm", "baddbmm"))
    out = [f"\nmtds thread CPU, rank 0: step {step:.1f} ms (median of the steps without the counter); ATen calls "
           f"{ops:.1f} ms (GEMMs {gemm:.1f}, the rest {ops - gemm:.1f}); between the calls {step - ops:.1f}",
           "| operator | input shapes | ms | calls |", "|---|---|---:|---:|"]
    out += [f"| {r['op']} | {r['shapes']} | {r['ms']:.2f} | {r['calls']} |" for r in rows[:top]]
    threads = sorted((m.get("threads") or {}).items(), key=lambda kv: -kv[1])
    out += ["\nCPU per step of each thread of rank 0 (steps 2 .. the one before the counted step; /proc, 10 ms ticks)",
            *(f"  {name}: {s * 1e3:.1f} ms" for name, s in threads if s > 0)]
    return "\n".join(out)


def table(rows: list[dict], title: str, n: int) -> str:
    out = [f"\n{title}", "| operator / range | self ms | total ms | calls |", "|---|---:|---:|---:|"]
    for r in rows[:n]:
        out.append(f"| {r['name'][:70]} | {r['self_ms']:.1f} | {r['total_ms']:.1f} | {r['calls']} |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(peer_work.MODELS), default="gpt2")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--profile-step", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--compile", action="store_true", help="mtds with --compile")
    ap.add_argument("--thread-cpu", action="store_true",
                    help="instead of torch.profiler: thread CPU per ATen call and shape (mtds side, the last step)")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    overrides = {"compile": True} if a.compile else None
    if a.thread_cpu:
        m = profile_mtds(a.model, a.tp, a.pp, a.microbatches, a.steps, None, overrides, cpu_step=a.steps)
        print(f"mtds {a.model} tp={a.tp} pp={a.pp}: step times {[round(t, 3) for t in m['times']]}")
        print(thread_cpu_table(m, a.steps, a.top))
        return
    m = profile_mtds(a.model, a.tp, a.pp, a.microbatches, a.steps, a.profile_step, overrides)
    prof = m["profile"]
    total = sum(r["self_ms"] for r in prof["ops"])
    print(f"mtds {a.model} tp={a.tp} pp={a.pp}: step times {[round(t, 3) for t in m['times']]}")
    print(table(prof["ranges"], "mtds ranges", 40))
    print(table(prof["ops"], f"mtds top operators (self ms of the top {len(prof['ops'])}: {total:.0f})", a.top))
    if a.no_peer:
        return
    peer = peer_work.PEER_OF[a.model]
    why = peer_missing(peer)
    if why:
        print(f"\npeer {peer} skipped: {why}")
        return
    r = run_peer(peer, a.model, a.tp, a.pp, a.microbatches, a.steps, 1, profile_step=a.profile_step)
    if "error" in r:
        print(f"\npeer {peer} failed: {r['error']}")
        return
    print(f"\n{peer} {a.model} tp={a.tp}: step times {r['step_times_s']}")
    print(table(r["profile"]["ops"], f"{peer} top operators", a.top))


if __name__ == "__main__":
    main()
