"""`mtds-plan`: predict memory and throughput of 3D layouts, rank them, or evaluate one.

Modes:
  rank (default)      every feasible layout ranked by predicted step time;
  evaluate            one layout (given when --tp or --pp is passed, or with --evaluate); knobs
                      left out are chosen by the planner and reported;
  --calibrate         measure this machine into a device profile (GPU type "local").
"""
from __future__ import annotations

import argparse
import json
import sys

from mtds.parallel.choices import CP_COMM_TYPES, PIPELINE_SCHEDULES, RECOMPUTE_MODES
from mtds.plan.candidate import Workload
from mtds.plan.hardware import DEFAULT_PROFILE, Cluster, get_gpu, gpu_names
from mtds.plan.model_spec import ModelSpec, resolve_model


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mtds-plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    m = ap.add_argument_group("model")
    m.add_argument("--model", help="preset name or HF config (file/dir); explicit sizes override it")
    m.add_argument("--layers", type=int)
    m.add_argument("--hidden", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 51200)")
    m.add_argument("--seq", type=int, default=None, help="sequence length (default 2048)")
    m.add_argument("--ffn-hidden", type=int, default=None, help="MLP width (default 4*hidden)")
    m.add_argument("--num-experts", type=int, default=None, help="MoE: experts per MoE block (0: dense)")
    m.add_argument("--moe-top-k", type=int, default=None, help="MoE: experts per token [2]")
    m.add_argument("--moe-ffn-hidden", type=int, default=None, help="MoE: width of one SwiGLU expert [--ffn-hidden]")
    m.add_argument("--moe-layers", type=int, default=None, help="MoE: how many blocks hold experts [all]")
    c = ap.add_argument_group("cluster")
    c.add_argument("--gpu", default="A100-80GB", help=f"one of {', '.join(gpu_names())}")
    c.add_argument("--gpus", type=int, help="total GPUs")
    c.add_argument("--nodes", type=int, help="nodes (GPUs = nodes x gpus-per-node)")
    c.add_argument("--gpus-per-node", type=int)
    c.add_argument("--intra-gbps", type=float, help="override intra-node GB/s per GPU per direction")
    c.add_argument("--inter-gbps", type=float, help="override inter-node GB/s per GPU per direction")
    c.add_argument("--profile", help=f"device profile for --gpu local (default {DEFAULT_PROFILE})")
    w = ap.add_argument_group("workload")
    w.add_argument("--global-batch", type=int, help="sequences per step")
    w.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None)
    w.add_argument("--tokens", type=float, default=300e9, help="tokens for the days-to-train estimate")
    lay = ap.add_argument_group("layout knobs (left out = chosen by the planner)")
    lay.add_argument("--tp", type=int)
    lay.add_argument("--pp", type=int)
    lay.add_argument("--dp", type=int)
    lay.add_argument("--context-parallel-size", "--cp", dest="cp", type=int,
                     help="context-parallel size c (train.py --cp): held in ranking and evaluation; left out, "
                          "c > 1 is searched for sequences >= 32768 or when nothing fits at c = 1")
    lay.add_argument("--cp-comm-type", choices=CP_COMM_TYPES,
                     help="context-parallel attention (train.py --cp-comm-type): p2p ring or a2a Ulysses")
    lay.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=int,
                     help="expert-parallel size e (train.py --ep), a divisor of d and of the experts; left out, "
                          "an MoE model's search tries each such divisor (train.py runs e > 1 with ZeRO 0-2; 16-bit at ZeRO 1-2)")
    lay.add_argument("--microbatch", type=int)
    lay.add_argument("--virtual-stages", type=int, help="model chunks per pipeline rank (interleaved: v > 1)")
    lay.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES,
                     help="pipeline schedule (train.py --pipeline-schedule); default: the planner tries each")
    lay.add_argument("--pipeline-layout", metavar="LAYOUT",
                     help="evaluate with this partition (train.py --pipeline-layout syntax, e.g. 'Et*5|t*3L')")
    lay.add_argument("--pipeline-balance", choices=("uniform", "cost"),
                     help="evaluate with this partition (train.py --pipeline-balance) [cost]; the report also "
                          "names the cost partition it recommends")
    lay.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3))
    lay.add_argument("--zero2-pipeline-reduce", choices=("micro-batch", "step"),
                     help="ZeRO-2 with --pp > 1 (train.py's flag): reduce-scatter every micro-batch (gradients 1/d "
                          "between micro-batches, m x the reduce-scatter's bytes) or once per step (ZeRO-1's) "
                          "[micro-batch]")
    lay.add_argument("--zero3-pipeline-gather", choices=("step", "micro-batch"),
                     help="ZeRO-3 with --pp > 1 (train.py's flag): gather the stage's parameters once per step "
                          "(ZeRO-1's bytes) or before every forward and backward pass (2m all-gathers a step, "
                          "gradients reduce-scattered per micro-batch) [step]")
    lay.add_argument("--recompute", choices=RECOMPUTE_MODES)
    lay.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None)
    o = ap.add_argument_group("output")
    o.add_argument("--evaluate", action="store_true", help="evaluate one layout even without --tp/--pp")
    o.add_argument("--top", type=int, default=10, help="layouts to show when ranking (0 = all)")
    o.add_argument("--show-infeasible", action="store_true", help="also list infeasible layouts and why")
    o.add_argument("--include-unrunnable", action="store_true",
                   help="also rank layouts train.py cannot run yet (flagged; see mtds/plan/runnable.py)")
    o.add_argument("--json", action="store_true", help="print JSON instead of a table")
    o.add_argument("--calibrate", action="store_true", help="measure this machine and save a device profile")
    o.add_argument("--calibrate-ranks", type=int, default=2,
                   help="gloo ranks for --calibrate: as many as the runs to predict put on this host (contention)")
    o.add_argument("--calibrate-engine", action="store_true",
                   help="with --calibrate: also measure DeepSpeed's per-micro-batch engine overhead (~15 s)")
    return ap


def _model(args) -> ModelSpec:
    sizes = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab,
             "seq": args.seq, "ffn_hidden": args.ffn_hidden, "num_experts": args.num_experts,
             "moe_top_k": args.moe_top_k, "moe_ffn_hidden": args.moe_ffn_hidden, "moe_layers": args.moe_layers}
    if args.model:
        spec = resolve_model(args.model, seq=args.seq)
        return ModelSpec(**{**spec.__dict__, **{k: v for k, v in sizes.items() if v is not None}})
    missing = [k for k in ("layers", "hidden", "heads") if sizes[k] is None]
    if missing:
        raise SystemExit(f"mtds-plan: give --model or all of --layers/--hidden/--heads (missing {missing})")
    return ModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab or 51200,
                     seq=args.seq or 2048, ffn_hidden=args.ffn_hidden,
                     **{k: sizes[k] for k in ("num_experts", "moe_top_k", "moe_ffn_hidden", "moe_layers")
                        if sizes[k] is not None})


def _cluster(args, precision: str) -> Cluster:
    gpu = get_gpu(args.gpu, precision, profile=args.profile)
    per_node = args.gpus_per_node or gpu.gpus_per_node
    gpus = args.gpus or (args.nodes * per_node if args.nodes else None)
    if not gpus:
        raise SystemExit("mtds-plan: give --gpus or --nodes")
    return Cluster(gpu, gpus, gpus_per_node=args.gpus_per_node, intra_gbps=args.intra_gbps,
                   inter_gbps=args.inter_gbps)


def visible_gpus() -> int:
    """GPUs torch sees (0 on a CPU build or with CUDA_VISIBLE_DEVICES=). On an H100 machine --calibrate
    silently profiled the host's cores (0.54 TFLOP/s, 2026-11-24): a profile nobody planning GPU runs wants."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _calibrate(args) -> int:
    from mtds.plan.calibrate import run_calibration, save_profile

    prof = run_calibration(world_size=args.calibrate_ranks, engine=args.calibrate_engine)
    path = save_profile(prof, args.profile)
    if args.json:
        print(json.dumps({**prof, "path": str(path)}, indent=2))
    else:
        print(f"device profile written to {path}")
        for k, v in prof.items():
            print(f"  {k}: {v}")
    return 0


def with_partition(model, work, cluster, pr, layout_text: str | None, balance: str | None):
    """``pr`` re-predicted under the partition train.py would build (--pipeline-layout, else
    --pipeline-balance through train.py's own rule, :func:`run_partition`, which prices ``cost`` on
    REFERENCE_GPU), with the cost partition priced on *this* cluster beside it as the recommendation
    (pass it as --pipeline-layout where the two differ)."""
    from dataclasses import replace

    from mtds.parallel.pipeline_layout import parse_layout
    from mtds.plan.balance import balanced_layout, run_partition
    from mtds.plan.predict import predict
    lay = pr.layout
    if layout_text:
        stages = parse_layout(layout_text, stages=lay.pp * lay.virtual_stages, num_layers=model.layers)
    else:
        stages = run_partition(model, lay, work, cluster.gpus, balance, cluster.gpu.hbm_gib * 1024 ** 3)
    used = predict(model, lay, work, cluster, stages=stages)
    best = balanced_layout(model, lay, work, cluster)
    recommended = predict(model, lay, work, cluster, stages=best)
    return replace(used, stages={**used.stages, "recommended": str(best),
                                 "recommended_step_time_s": recommended.step_time_s})


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.calibrate:
        if args.calibrate_ranks < 2:     # the all-reduce fit needs a ring
            parser.error(f"--calibrate-ranks must be >= 2 (it fits a ring all-reduce), got {args.calibrate_ranks}")
        gpus = visible_gpus()
        if gpus:
            parser.error(f"--calibrate measures this host's CPU cores with gloo ranks (it has no GPU mode yet), "
                         f"but torch sees {gpus} GPU(s) here: plan GPU runs with the datasheet entry "
                         f"(--gpu {', '.join(g for g in gpu_names() if g != 'local')}), or hide the GPUs "
                         f"(CUDA_VISIBLE_DEVICES= mtds-plan --calibrate) to profile the cores anyway")
        return _calibrate(args)
    if not args.global_batch:
        raise SystemExit("mtds-plan: --global-batch is required")
    precision = args.precision or ("fp32" if args.gpu == "local" else "bf16")
    try:
        model, cluster = _model(args), _cluster(args, precision)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"mtds-plan: {exc}")
    work = Workload(args.global_batch, precision, args.tokens)
    knobs = {k: getattr(args, k) for k in ("tp", "pp", "dp", "microbatch", "virtual_stages", "zero_stage",
                                           "recompute", "sequence_parallel", "pipeline_schedule", "cp",
                                           "cp_comm_type", "ep", "zero2_pipeline_reduce",
                                           "zero3_pipeline_gather")}
    runnable_only = not args.include_unrunnable

    from mtds.plan import report
    from mtds.plan.search import evaluate, plan

    if args.evaluate or args.tp is not None or args.pp is not None:
        pr = evaluate(model, work, cluster, runnable_only=runnable_only, **knobs)
        if pr.layout.pp > 1:
            try:
                pr = with_partition(model, work, cluster, pr, args.pipeline_layout, args.pipeline_balance)
            except ValueError as exc:
                raise SystemExit(f"mtds-plan: {exc}")
        if args.json:
            print(json.dumps({**pr.as_dict(), **report.context_dict(model, work, cluster)}, indent=2))
        elif sys.stdout.isatty():
            report.render_table(model, work, cluster, [pr], title="Evaluated layout")
            if pr.stages:
                print(report.partition_line(pr))
            if pr.reasons:
                print("infeasible: " + "; ".join(pr.reasons))
            if pr.not_runnable:
                print("not runnable: " + "; ".join(pr.not_runnable))
        else:
            print(report.render_text(pr))
        return 0 if pr.feasible else 1

    result = plan(model, work, cluster, keep_infeasible=args.show_infeasible, runnable_only=runnable_only, **knobs)
    top = None if args.top == 0 else args.top
    if args.json:
        print(json.dumps(report.plan_dict(model, work, cluster, result, top, args.show_infeasible), indent=2))
    else:
        from rich.console import Console

        console = Console()
        shown = result.feasible if top is None else result.feasible[:top]
        report.render_table(model, work, cluster, shown,
                            title=f"{len(result.feasible)} feasible layouts, fastest first", console=console)
        if args.show_infeasible:
            report.render_infeasible(result.infeasible, console)
    return 0 if result.feasible else 1


if __name__ == "__main__":
    sys.exit(main())
