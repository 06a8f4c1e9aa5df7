"""`python -m compare`: PTD-P (Megatron tensor x pipeline parallelism on DeepSpeed, ZeRO-1) vs ZeRO-3.

  run      train every scheme on this machine with train.py's code path (torchrun, one process per
           rank), same model, init, data and global batch; write compare.md / compare.json (tokens/s,
           TFLOP/s per rank, peak memory, bytes communicated per step per rank) and loss.png /
           throughput.png. The loss curves should overlay: identical weights and samples.
           With --nodes N: on an emulated cluster of N nodes (network namespaces, tc-shaped links; root
           and iproute2), once per --inter-node speed, launched per node by DeepSpeed's multi-node
           launcher; writes results.{md,csv,json}, tokens_vs_bandwidth.png, link_bytes.png, loss.png,
           with the planner's prediction beside every cell.
  project  put the same schemes through the planner (mtds.plan) for a GPU cluster; without --model,
           project PTD-P's Table 2 layouts (GPT-3 175B / 530B on A100s) next to the paper's numbers.

Scheme specs: ptdp:tp=T,pp=P (ZeRO-1, ds_configs/cpu_fp32.json), zero3 (tp=1 pp=1, ZeRO-3,
ds_configs/cpu_zero3_fp32.json), zero1 (plain data parallel, ZeRO-1), hf-zero3 (HF model under
accelerate + DeepSpeed ZeRO-3), autotp:tp=T (HF model under DeepSpeed AutoTP), megatron:tp=T,pp=P
(Megatron-core's own GPT) and torchtitan:tp=T,fsdp=F (torchtitan's Llama-3), the two peers, run in their
own interpreter (`make peers`; without them their rows fail saying how to get them); add config=FILE to
use another DeepSpeed JSON.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap

EXAMPLES = textwrap.dedent("""\
    examples:
      python -m compare run --schemes ptdp:tp=2,pp=2 zero3 --nproc 4 --model gpt2-tiny --steps 20 --out runs/compare
      python -m compare run --nodes 2 --ranks-per-node 2 --inter-node 10gbit,1gbit,100mbit \
          --schemes ptdp:tp=2,pp=2 zero3 zero1 hf-zero3 autotp:tp=2 --out runs/cluster-sweep
      make peers     # once: Megatron-core and torchtitan in their own venv, for the two peer schemes
      python -m compare run --nodes 2 --ranks-per-node 2 --inter-node 1gbit,20mbit --model compare/llama_tiny.json \
          --global-batch 16 --micro-batch 4 --schemes ptdp:tp=2,pp=2 megatron:tp=2,pp=2 torchtitan:tp=2,fsdp=2 \
          --out runs/peers-sweep
      python -m compare project                                    # PTD-P Table 2 vs the planner
      python -m compare project --schemes ptdp:tp=8,pp=12 zero3 --model gpt2-xl --gpus 64 --global-batch 512
    """)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m compare", description=__doc__, epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train each scheme here and compare", epilog=EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--schemes", nargs="+", default=["ptdp:tp=2,pp=2", "zero3"], help="[ptdp:tp=2,pp=2 zero3]")
    run.add_argument("--nproc", type=int, default=4, help="ranks per scheme (all on this machine) [4]")
    run.add_argument("--model", default="gpt2-tiny", help="preset or HF config.json (as train.py --model)")
    run.add_argument("--steps", type=int, default=20)
    run.add_argument("--seq-length", type=int, default=128)
    run.add_argument("--global-batch", type=int, help="samples per step for every scheme [from the configs]")
    run.add_argument("--micro-batch", type=int, help="micro batch for every scheme [from the configs]")
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds per scheme [3600]")
    run.add_argument("--out", default="runs/compare")
    run.add_argument("--nodes", type=int, help="emulate this many nodes (network namespaces; root + iproute2)")
    run.add_argument("--ranks-per-node", type=int, default=2, help="with --nodes: ranks per node [2]")
    run.add_argument("--inter-node", default="10gbit,1gbit,100mbit",
                     help="with --nodes: comma-separated link speeds, tc units [10gbit,1gbit,100mbit]")
    run.add_argument("--latency", default="0", help="with --nodes: one-way delay per packet (needs netem) [0]")
    run.add_argument("--warmup", type=int, default=1, help="steps excluded from timings [1]")
    run.add_argument("--profile", help="with --nodes: planner device profile [calibrate this machine first]")
    run.add_argument("--no-predict", action="store_true", help="with --nodes: skip the planner column")
    run.add_argument("--lock", help="with --nodes: hold this flock file while each link speed runs (shared machines)")
    run.add_argument("--prefix", default="mtds-", help=argparse.SUPPRESS)
    proj = sub.add_parser("project", help="predict the schemes on a GPU cluster (planner)", epilog=EXAMPLES,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    proj.add_argument("--schemes", nargs="+", default=["ptdp:tp=8,pp=12", "zero3"])
    proj.add_argument("--model", help="preset or HF config; without it: PTD-P Table 2's own layouts")
    proj.add_argument("--gpus", type=int, default=384)
    proj.add_argument("--global-batch", type=int, default=1536)
    proj.add_argument("--micro-batch", type=int, default=1)
    proj.add_argument("--gpu", default="A100-80GB")
    proj.add_argument("--precision", default="fp16", choices=("fp16", "bf16", "fp32"))
    proj.add_argument("--out", help="also write project.md / project.json here")
    return ap


def cmd_run_cluster(args) -> int:
    from .plots import write_sweep_plots
    from .results import write_results
    from .sweep import run_sweep
    if not (args.global_batch and args.micro_batch):
        raise ValueError("--nodes needs --global-batch and --micro-batch (the same batch for every scheme)")
    try:
        rows, meta = run_sweep(args)
    except KeyboardInterrupt:
        print("[compare] interrupted; the emulated cluster was torn down", file=sys.stderr)
        return 130
    print(write_results(rows, meta, args.out))
    for path in write_sweep_plots(rows, meta["links"], args.out):
        print(f"[compare] wrote {path}")
    return 0


def refuse_missing_peers(schemes) -> None:
    """Before anything starts: a peer scheme whose framework is not installed is one line saying how to get it."""
    from .peer_launch import peer_missing
    for kind in dict.fromkeys(s.kind for s in schemes if s.peer):
        why = peer_missing(kind)
        if why:
            raise ValueError(why)


def cmd_run(args) -> int:
    if args.nodes:
        return cmd_run_cluster(args)
    from .launch import launch
    from .peer_launch import launch_peer
    from .plots import write_plots
    from .schemes import for_run, parse_scheme
    from .table import loss_agreement, summarise, write
    schemes = [for_run(parse_scheme(s), args.model) for s in args.schemes]
    for s in schemes:
        s.data_parallel(args.nproc)           # refuse a bad world size before anything starts
    refuse_missing_peers(schemes)
    rows = []
    for s in schemes:
        print(f"[compare] {s.name}: {args.nproc} ranks, config {os.path.basename(s.config)}", flush=True)
        launched = (launch_peer if s.peer else launch)(s, nproc=args.nproc, model=args.model, steps=args.steps, seq_length=args.seq_length,
                          out_dir=os.path.join(args.out, s.name), global_batch=args.global_batch,
                          micro_batch=args.micro_batch, timeout=args.timeout)
        rows.append(summarise(launched))
        print(f"[compare] {s.name}: {rows[-1]['tokens_per_s']:,.0f} tokens/s, final loss {rows[-1]['final_loss']:.4f} "
              f"({launched['wall_s']:.0f} s)", flush=True)
    worst, sentence = loss_agreement(rows)
    meta = {"nproc": args.nproc, "model": args.model, "steps": args.steps, "seq_length": args.seq_length,
            "loss_agreement": sentence, "step1_max_relative_loss_difference": worst}
    print(write(rows, meta, args.out))
    for path in write_plots(rows, args.out):
        print(f"[compare] wrote {path}")
    return 0


def cmd_project(args) -> int:
    import json

    from .project import PlannerUnavailable, markdown, paper_rows, scheme_rows
    from .schemes import parse_scheme
    try:
        if args.model:
            rows = scheme_rows([parse_scheme(s) for s in args.schemes], args.model, args.gpus, args.global_batch,
                               args.micro_batch, args.gpu, args.precision)
            title = f"{args.model} on {args.gpus} x {args.gpu}, global batch {args.global_batch} (planner)"
        else:
            rows = paper_rows(args.gpu, args.precision)
            title = "PTD-P vs ZeRO-3, Narayanan et al. 2021 Table 2: paper vs planner"
    except PlannerUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = markdown(rows, title)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "project.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "project.json"), "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return cmd_run(args) if args.command == "run" else cmd_project(args)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
