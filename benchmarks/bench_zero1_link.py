"""ZeRO-1's data-parallel bytes on the emulated cluster's links: mtds's gradient reduce-scatter against
DeepSpeed's all-reduce, same model, data and seed, runs alternated (A B A B) on 2 nodes x 2 ranks.

Per scheme and node: the bytes the node's eth0 sent per step (kernel counters), the formula
(mtds.cluster.formulas.zero1_link_bytes) and the tracer's inter-node split; the step time (median over
the timed steps) and the losses (equal up to the summation order). Needs root (network namespaces).

    python -m benchmarks.bench_zero1_link [--inter-node 1gbit] [--repeats 2] [--schemes zero1 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from compare.cluster_launch import launch_on_cluster
from compare.schemes import parse_scheme
from mtds.cluster import Cluster, ClusterSpec

RANKS_PER_NODE, NODES = 2, 2


def _ranks(out_dir: str) -> list[dict]:
    probe = os.path.join(out_dir, "probe")
    return [json.load(open(os.path.join(probe, f))) for f in sorted(os.listdir(probe)) if f.startswith("rank")]


def measure(cluster: Cluster, scheme: str, out_dir: str, args) -> dict:
    launch_on_cluster(cluster, parse_scheme(scheme), model=args.model, steps=args.steps, seq_length=args.seq_length,
                      global_batch=args.global_batch, micro_batch=args.micro_batch, out_dir=out_dir, echo=None,
                      timeout=900)
    ranks = _ranks(out_dir)
    timed = slice(args.warmup, None)
    link = [statistics.mean(s["tx_bytes"] for s in ranks[node]["link_per_step"][timed])
            for node in range(0, NODES * RANKS_PER_NODE, RANKS_PER_NODE)]
    traced = [statistics.mean(sum(v.get("inter_bytes", 0) for r in ranks[node:node + RANKS_PER_NODE]
                                  for v in r["comm_per_step"][step].values())
                              for step in range(args.warmup, args.steps))
              for node in range(0, NODES * RANKS_PER_NODE, RANKS_PER_NODE)]
    step_s = statistics.median(t for r in ranks for t in r["step_times_s"][timed])
    return {"link": link, "traced": traced, "step_s": step_s, "losses": ranks[0]["losses"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inter-node", default="1gbit")
    p.add_argument("--schemes", nargs="+", default=["zero1", "zero1:grad_reduce=all-reduce"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    args = p.parse_args(argv)
    from compare.sweep import link_formula           # the sweep's own formula (parameter count included)
    out = tempfile.mkdtemp(prefix="mtds-zero1-link-")
    results = {name: [] for name in args.schemes}
    spec = ClusterSpec(nodes=NODES, ranks_per_node=RANKS_PER_NODE, inter_node=args.inter_node)
    with Cluster(spec) as cluster:
        for repeat in range(args.repeats):
            for name in args.schemes:              # alternated: both see the same load
                results[name].append(measure(cluster, name, os.path.join(out, f"{name}-{repeat}"), args))
    print(f"ZeRO-1 d = 4 over {NODES} nodes x {RANKS_PER_NODE} ranks, {args.inter_node}, {args.model}, "
          f"{args.steps - args.warmup} timed steps, {args.repeats} repeats alternated")
    print("| gradients | link B/step/node: counters (formula) | traced inter-node | step s (median per repeat) |")
    print("|---|---:|---:|---:|")
    for name, runs in results.items():
        scheme = parse_scheme(name)
        grad_reduce = scheme.grad_reduce
        formula = link_formula(scheme, args.model, args.seq_length, args.global_batch, args.micro_batch, spec)
        link = statistics.mean(x for r in runs for x in r["link"])
        traced = statistics.mean(x for r in runs for x in r["traced"])
        steps = ", ".join(f"{r['step_s']:.3f}" for r in runs)
        print(f"| {grad_reduce} | {link / 1e6:.2f} MB ({formula / 1e6:.2f} MB, {link / formula - 1:+.1%}) | "
              f"{traced / 1e6:.2f} MB | {steps} |")
    first = [results[name][0]["losses"] for name in args.schemes]
    print("max loss rel. diff between schemes:",
          max(abs(a - b) / abs(b) for other in first[1:] for a, b in zip(first[0], other)))


if __name__ == "__main__":
    main()
