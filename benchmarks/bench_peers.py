#!/usr/bin/env python
"""mtds next to Megatron-core (GPT-2) and torchtitan (Llama) on identical work, alternating runs (issue 21).

    python benchmarks/bench_peers.py                              # gpt2 + llama, tp 1 2, 3 repetitions
    python benchmarks/bench_peers.py --models gpt2 --tp 1 --reps 5
    python benchmarks/bench_peers.py --models gpt2 --tp 1 --pp 2 --microbatches 4
    python benchmarks/bench_peers.py --mtds-only --models llama --compile   # no peer; mtds with --compile

The work (benchmarks/peer_work.py): 4 layers, hidden 256, 4 heads, vocabulary 8192, sequence 256,
micro-batch 4, fp32, AdamW, clipping 1.0, no dropout. For every repetition and configuration the peer and
mtds run back to back, the order flipped each repetition, each in fresh processes; tokens/s is
micro-batches * b * s / median step time over steps warmup+1..steps, then the median over repetitions.
An mtds step is a whole loop iteration, hooks included (benchmarks/mtds_steps.py); a peer's is its loop
body (bench_peer.py). torchtitan computes in bf16 by default (its FSDP mixed-precision policy); here it
is set to float32 like the other two (``--tt-dtype bfloat16`` keeps its default).

The peers are not part of mtds: they run through ``../shared/tools/peers/bench_peer.py`` in their own
interpreter (``PEERS_PYTHON`` / ``PEERS_WORK``, ``MTDS_PEERS_DIR``). Where a peer is not installed, its
rows are skipped, saying why, and only mtds runs. Also printed: the GEMM peak of one core measured in the
same process tree (mtds.observe.metrics.cpu_gemm_peak) and each side's model FLOP/s per core as a fraction of it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import peer_work                             # noqa: E402
from lab.measure import median                        # noqa: E402
from benchmarks.peer_runner import peer_missing, run_peer    # noqa: E402


def run_mtds(model: str, tp: int, pp: int, microbatches: int, steps: int, warmup: int, overrides: dict) -> dict:
    from benchmarks.mtds_steps import train_mtds
    from lab.testing import spawn
    workdir = tempfile.mkdtemp(prefix="bench_peers_")
    r = spawn(train_mtds, tp * pp, model, tp, pp, microbatches, steps, warmup, None, workdir, overrides,
              timeout=900, fresh=True)
    # a step's time is the slowest rank's, as the peers report it
    times = [max(per_rank) for per_rank in zip(*(x["times"] for x in r))]
    step = median(times[warmup:])
    return {"side": "mtds", "tokens_per_s": microbatches * peer_work.MICRO_BATCH * peer_work.SEQ / step,
            "median_step_s": step, "step_times_s": [round(t, 4) for t in times],
            "losses": [round(x, 5) for x in r[0]["losses"]]}


def model_flops_per_step(model: str, microbatches: int) -> float:
    from mtds.hf.resolve import resolve_model_config
    from mtds.observe.metrics import model_config_flops
    cfg = resolve_model_config(peer_work.write_model_config(model, tempfile.mkdtemp(prefix="bench_peers_cfg_")))
    return model_config_flops(cfg, peer_work.MICRO_BATCH * microbatches, peer_work.SEQ)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=sorted(peer_work.MODELS), default=["gpt2", "llama"])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (Megatron-core peer only) [1]")
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="mtds with --compile")
    ap.add_argument("--mtds-only", action="store_true", help="no peer runs")
    ap.add_argument("--tt-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="torchtitan's compute dtype (its FSDP param_dtype) [float32: the same work as mtds]")
    ap.add_argument("--out", default=None, help="append every run as a JSON line to this file")
    ap.add_argument("--first-rep", type=int, default=0,
                    help="number of the first repetition: odd ones run mtds first (to alternate over invocations)")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from mtds.observe.gemm_peak import cpu_gemm_peak
    peak = cpu_gemm_peak()
    print(f"GEMM peak of one core: {peak / 1e9:.1f} GFLOP/s (fp32 torch.matmul, this process); "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    overrides = {"compile": True} if a.compile else {}
    rows = []
    for rep in range(a.reps):
        for model in a.models:
            peer = peer_work.PEER_OF[model]
            why = None if not a.mtds_only else "--mtds-only"
            why = why or peer_missing(peer) or (None if peer == "megatron" or a.pp == 1 else
                                                f"{peer}: --pp is wired for Megatron-core only")
            if why and rep == 0:
                print(f"[skip] {peer}: {why}", flush=True)
            for tp in a.tp:
                sides = ["mtds"] if why else (["peer", "mtds"] if (rep + a.first_rep) % 2 == 0 else ["mtds", "peer"])
                for side in sides:
                    t0 = time.time()
                    if side == "peer":
                        r = run_peer(peer, model, tp, a.pp, a.microbatches, a.steps, a.warmup,
                                     tt_param_dtype=a.tt_dtype)
                        r["side"] = peer
                    else:
                        r = run_mtds(model, tp, a.pp, a.microbatches, a.steps, a.warmup, overrides)
                    r.update(rep=rep, model=model, tp=tp, pp=a.pp, load=round(os.getloadavg()[0], 2),
                             wall_s=round(time.time() - t0, 1))
                    r.pop("profile", None)
                    rows.append(r)
                    if a.out:
                        with open(a.out, "a") as f:
                            f.write(json.dumps(r) + "\n")
                    tps = r.get("tokens_per_s")
                    print(f"[rep {rep + 1}/{a.reps}] {model} tp={tp} pp={a.pp} {r['side']:10s} "
                          + (f"{tps:8.0f} tok/s (load {r['load']})" if tps else f"ERROR {str(r.get('error'))[:300]}"),
                          flush=True)
    print("\n| model | tp | pp | peer | peer tok/s | mtds tok/s | mtds / peer | paired ratios | peer % of GEMM peak | "
          "mtds % of GEMM peak |\n|---|---|---|---|---:|---:|---:|---|---:|---:|")
    for model in a.models:
        flops = model_flops_per_step(model, a.microbatches)
        for tp in a.tp:
            mine = [r for r in rows if r["model"] == model and r["tp"] == tp and r.get("tokens_per_s")]
            p = median([r["tokens_per_s"] for r in mine if r["side"] != "mtds"])
            m = median([r["tokens_per_s"] for r in mine if r["side"] == "mtds"])
            tokens = a.microbatches * peer_work.MICRO_BATCH * peer_work.SEQ

            def frac(tps):   # model FLOP/s per core over the GEMM peak of one core
                return flops * tps / tokens / (tp * a.pp) / peak if tps == tps else float("nan")

            # each repetition's mtds / peer: the two ran back to back, so under the same load
            paired = [mr["tokens_per_s"] / pr["tokens_per_s"] for pr in mine for mr in mine
                      if pr["side"] != "mtds" and mr["side"] == "mtds" and pr["rep"] == mr["rep"]]
            print(f"| {model} | {tp} | {a.pp} | {peer_work.PEER_OF[model]} | {p:,.0f} | {m:,.0f} | {m / p:.2f} | "
                  f"{', '.join(f'{x:.2f}' for x in paired)} | {frac(p):.0%} | {frac(m):.0%} |")


if __name__ == "__main__":
    main()
