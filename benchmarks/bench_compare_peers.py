#!/usr/bin/env python
"""mtds / peer tokens/s through `python -m compare run`'s own launchers, on this host, A/B alternated.

    python benchmarks/bench_compare_peers.py                  # tp 1, tp 2, pp 2 (4 micro-batches), 2 repetitions
    python benchmarks/bench_compare_peers.py --cells tp2 --reps 3 --out runs/peers.jsonl

Each cell runs mtds (ptdp:tp=T,pp=P) and the peer (megatron:... on the GPT-2 work, torchtitan:... on the
Llama work: torchtitan has no pipeline here, so it has no pp cell) back to back, in fresh processes, the
order flipped every repetition, so each ratio is taken under the same machine load. The work is
benchmarks/peer_work.py's (4 layers, hidden 256, 4 heads, vocabulary 8192, sequence 256, micro-batch 4,
fp32, AdamW, clipping 1.0) on the samples every compare scheme trains on; tokens/s is the median over the
steps after --warmup. Each run also records process CPU seconds per step (the busiest rank's, median):
on a host shared with other jobs tokens/s moves with the load, the CPU a step costs much less, so the
last column compares the work each side does per step. mtds runs with compare.entry's collective tracer
installed (the peers have none), so its side carries that overhead. Peers missing: their cells are skipped with the reason.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import peer_work                                        # noqa: E402
from lab.measure import median                                          # noqa: E402

CELLS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 4)}        # tp, pp, micro-batches per step


def run_side(spec: str, nproc: int, model: str, microbatches: int, steps: int, warmup: int, out: str) -> dict:
    from compare.launch import launch
    from compare.peer_launch import launch_peer
    from compare.schemes import parse_scheme
    from compare.table import summarise
    scheme = parse_scheme(spec)
    batch = dict(global_batch=peer_work.MICRO_BATCH * microbatches, micro_batch=peer_work.MICRO_BATCH)
    launched = (launch_peer if scheme.peer else launch)(scheme, nproc=nproc, model=model, steps=steps,
                                                        seq_length=peer_work.SEQ, out_dir=out, timeout=1800, **batch)
    row = summarise(launched, warmup=warmup)
    return {"scheme": scheme.name, "tokens_per_s": row["tokens_per_s"], "losses": row["losses"],
            "framework": row.get("framework", "mtds"), "parameters": row.get("parameters"),
            "cpu_s": row["cpu_s_per_step"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", choices=sorted(CELLS), default=["tp1", "tp2", "pp2"])
    ap.add_argument("--models", nargs="+", choices=sorted(peer_work.MODELS), default=["gpt2", "llama"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", help="append every run as a JSON line here")
    a = ap.parse_args(argv)
    from compare.peer_launch import peer_missing
    work = tempfile.mkdtemp(prefix="bench_compare_peers_")
    rows = []
    print(f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    for rep in range(a.reps):
        for model in a.models:
            peer = peer_work.PEER_OF[model]
            why = peer_missing(peer)
            if why:
                print(f"[skip] {why}", flush=True)
                continue
            config = peer_work.write_model_config(model, work)
            for cell in a.cells:
                tp, pp, m = CELLS[cell]
                if peer == "torchtitan" and pp > 1:
                    continue
                sides = [f"ptdp:tp={tp},pp={pp}", f"{peer}:tp={tp},pp={pp}" if peer == "megatron" else f"{peer}:tp={tp}"]
                for spec in (sides if rep % 2 == 0 else sides[::-1]):
                    r = run_side(spec, tp * pp, config, m, a.steps, a.warmup,
                                 os.path.join(work, f"{rep}-{model}-{cell}-{spec.split(':')[0]}"))
                    r.update(rep=rep, model=model, cell=cell, load=round(os.getloadavg()[0], 2))
                    rows.append(r)
                    cpu = f"{r['cpu_s']:.3f}" if r["cpu_s"] is not None else "-"
                    print(f"[rep {rep + 1}] {model} {cell} {r['scheme']:24s} {r['tokens_per_s']:8,.0f} tok/s "
                          f"CPU {cpu} s/step (load {r['load']}) step-1 loss {r['losses'][0]:.4f}", flush=True)
                    if a.out:
                        with open(a.out, "a") as f:
                            f.write(json.dumps(r) + "\n")
    print("\n| model | cell | peer | peer tok/s | mtds tok/s | mtds / peer | paired ratios | CPU s/step peer / mtds |"
          "\n|---|---|---|---:|---:|---:|---|---|")
    for model in a.models:
        for cell in a.cells:
            mine = [r for r in rows if r["model"] == model and r["cell"] == cell]
            peer = [r for r in mine if r["framework"] != "mtds"]
            ours = [r for r in mine if r["framework"] == "mtds"]
            if not (peer and ours):
                continue
            paired = [o["tokens_per_s"] / p["tokens_per_s"] for o in ours for p in peer if o["rep"] == p["rep"]]
            pt, mt = median([r["tokens_per_s"] for r in peer]), median([r["tokens_per_s"] for r in ours])
            pc, mc = (median([r["cpu_s"] for r in side if r["cpu_s"] is not None] or [0.0]) for side in (peer, ours))
            work = f"{pc:.3f} / {mc:.3f} = {pc / mc:.2f}" if pc and mc else "-"
            print(f"| {model} | {cell} | {peer[0]['framework']} | {pt:,.0f} | {mt:,.0f} | {mt / pt:.2f} | "
                  f"{', '.join(f'{x:.2f}' for x in paired)} | {work} |")


if __name__ == "__main__":
    main()
