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
                 overrides: dict | None = None) -> dict:
    from benchmarks.mtds_steps import train_mtds
    from lab.testing import spawn
    workdir = tempfile.mkdtemp(prefix="mtds_profile_")
    return spawn(train_mtds, tp * pp, model, tp, pp, microbatches, steps, 1, step, workdir, overrides,
                 timeout=900)[0]


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
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    overrides = {"compile": True} if a.compile else None
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
