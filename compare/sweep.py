"""`python -m compare run --nodes N ...`: every scheme at every inter-node link speed on an emulated
cluster (mtds.cluster), each launched per node through DeepSpeed's multi-node launcher, with the
planner's prediction beside each measured cell.

For each link speed the cluster is built once (namespaces, bridge, shaped links) and every scheme runs
on it in turn: same model, initial weights, samples, global batch and seed. A scheme that fails is a row
with its error; the others still run. Ctrl-C (or SIGTERM) tears the cluster down.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re

from mtds.cluster import Cluster, ClusterSpec, unavailable_reason
from mtds.cluster.formulas import ptdp_link_bytes, zero1_link_bytes, zero3_link_bytes
from mtds.cluster.shaping import rate_bits

from .cluster_launch import launch_on_cluster
from .predict import calibrate, predict_cell
from .peer_launch import launch_peer_on_cluster
from .schemes import MODEL_ALIASES, Scheme, for_run, parse_scheme
from .table import summarise


def _first_error_line(out_dir: str, fallback: str) -> str:
    """The most telling line of a failed run: the last 'SomethingError: ...' in its node logs."""
    found = None
    for name in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []:
        if name.startswith("node") and name.endswith(".log"):
            with open(os.path.join(out_dir, name), errors="replace") as f:
                for line in f:
                    m = re.search(r"\b(\w+(Error|Exception): .*)$", line)
                    if m and "sigkill_handler" not in line:
                        found = m.group(1).strip()
    return (found or fallback.splitlines()[0])[:300]


@contextlib.contextmanager
def held(lock_path: str | None):
    """Hold an exclusive flock on `lock_path` (if given): a shared machine's jobs take turns, one link
    speed (all its schemes) per turn."""
    if not lock_path:
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def link_formula(scheme: Scheme, model: str, seq: int, global_batch: int, micro_batch: int,
                 spec: ClusterSpec, row: dict | None = None) -> float | None:
    """Bytes per node and step the formulas of mtds.cluster.formulas give, or None where none applies.
    ZeRO-3 with several micro-batches takes its all-gather volume from the tracer (`row`), see there."""
    from mtds.hf.resolve import resolve_model_config
    from mtds.observe.metrics import gpt_param_count
    cfg = resolve_model_config(model)
    if cfg.architecture != "gpt2" or not cfg.tie_word_embeddings:
        return None            # the formulas count GPT-2 shapes (tied embeddings, learned positions)
    params = int(gpt_param_count(cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.max_position_embeddings)
                 + 2 * cfg.hidden_size)                                  # + final layer norm
    world = spec.world
    if scheme.kind in ("zero3", "hf-zero3"):
        m = global_batch // (micro_batch * world)
        traced = (row or {}).get("comm_by_family_max_rank", {}).get("all_gather")
        gathered = traced * world / 4 if (m > 1 and traced) else None      # fp32 values gathered in all
        return zero3_link_bytes(params=params, world=world, nodes=spec.nodes, microbatches=m, gathered=gathered)
    if scheme.kind == "zero1" or (scheme.kind == "ptdp" and scheme.tp == 1 and scheme.pp == 1):
        return zero1_link_bytes(params=params, world=world, nodes=spec.nodes, grad_reduce=scheme.grad_reduce)
    if scheme.kind == "ptdp" and scheme.pp == spec.nodes and scheme.tp * scheme.data_parallel(world) <= spec.ranks_per_node:
        d = scheme.data_parallel(world)
        return ptdp_link_bytes(microbatches=global_batch // (micro_batch * d), micro_batch=micro_batch, seq=seq,
                               hidden=cfg.hidden_size, vocab=cfg.vocab_size, tp=scheme.tp, pp=scheme.pp,
                               nodes=spec.nodes)
    return None


def run_sweep(args) -> tuple[list[dict], dict]:
    reason = unavailable_reason()
    if reason:
        raise ValueError(f"--nodes needs an emulated cluster, which is unavailable here: {reason}")
    schemes = [for_run(parse_scheme(s), args.model) for s in args.schemes]
    world = args.nodes * args.ranks_per_node
    for s in schemes:
        s.data_parallel(world)
    from .cli import refuse_missing_peers
    refuse_missing_peers(schemes)
    speeds = [x.strip() for x in args.inter_node.split(",") if x.strip()]
    for speed in speeds:
        rate_bits(speed)
    profile = args.profile
    if profile is None and not args.no_predict:
        os.makedirs(args.out, exist_ok=True)
        print("[compare] calibrating this machine for the planner (mtds-plan --calibrate, ~1 min)", flush=True)
        with held(args.lock):
            # every node of the emulated cluster runs on this host: measure with all its ranks at once
            profile = calibrate(os.path.join(args.out, "device_profile.json"), world_size=world)
    batch = dict(global_batch=args.global_batch, micro_batch=args.micro_batch)
    references = {}
    for model in dict.fromkeys(s.model for s in schemes if s.model):
        # A scheme training its own model has no partner row: its losses are checked against mtds on one
        # rank on one host (same model, data, seed, batch).
        print(f"[compare] reference for {model}: mtds, 1 rank on this host", flush=True)
        with held(args.lock):
            references[model] = host_reference(MODEL_ALIASES.get(model, model), args,
                                               os.path.join(args.out, "reference", os.path.basename(model)))
    rows, total = [], len(speeds) * len(schemes)
    for speed in speeds:
        spec = ClusterSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node, inter_node=speed,
                           latency=args.latency, prefix=args.prefix)
        with held(args.lock), Cluster(spec) as cluster:      # one link speed's runs in one turn
            for s in schemes:
                out_dir = os.path.join(args.out, speed, s.name)
                print(f"[compare] {len(rows) + 1}/{total} {speed} {s.name}: {args.nodes} nodes x {args.ranks_per_node} "
                      f"ranks", flush=True)
                row = {"scheme": s.name, "kind": s.kind, "tp": s.tp, "pp": s.pp, "dp": s.data_parallel(world),
                       "model": s.model or args.model, "grad_reduce": s.grad_reduce}
                if s.pp > 1:     # the partition train.py builds (compare.predict.run_partition re-derives it)
                    from mtds.plan.balance import DEFAULT_BALANCE
                    # Megatron-core splits the layers evenly over its stages
                    row["pipeline_balance"] = "uniform" if s.kind == "megatron" else DEFAULT_BALANCE
                try:
                    launched = (launch_peer_on_cluster if s.peer else launch_on_cluster)(cluster, s, model=args.model, steps=args.steps,
                                                 seq_length=args.seq_length, out_dir=out_dir, timeout=args.timeout,
                                                 **batch, echo=print if speed == speeds[0] else None)
                    row.update(summarise(launched, warmup=args.warmup, ranks_per_node=args.ranks_per_node),
                               status="ok", commands=launched["commands"])
                except RuntimeError as err:
                    row.update(status="error", error=_first_error_line(out_dir, str(err)))
                row.update(link=speed, link_bits_per_s=rate_bits(speed), nodes=args.nodes,
                           ranks_per_node=args.ranks_per_node,
                           link_formula_bytes=link_formula(s, s.model_path(args.model), args.seq_length, args.global_batch,
                                                           args.micro_batch, spec, row))
                if profile:
                    try:
                        row["predicted"] = predict_cell(s, model=s.model_path(args.model), seq=args.seq_length,
                                                        global_batch=args.global_batch, micro_batch=args.micro_batch,
                                                        world=world, ranks_per_node=args.ranks_per_node,
                                                        link_bytes_per_s=spec.link_bytes_per_s, profile=profile,
                                                        balance=row.get("pipeline_balance"))
                    except (ValueError, RuntimeError) as err:
                        row["predicted"] = {"error": str(err).splitlines()[0]}
                rows.append(row)
                print(_progress(row), flush=True)
    meta = {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "links": speeds, "latency": args.latency,
            "model": args.model, "steps": args.steps, "warmup": args.warmup, "seq_length": args.seq_length,
            "global_batch": args.global_batch, "micro_batch": args.micro_batch, "profile": profile,
            "references": references}
    return rows, meta


def host_reference(model: str, args, out_dir: str) -> list[float] | str:
    """Losses of mtds at (1,1,1) on this host for `model` with the sweep's batch and steps; the error
    line where it fails."""
    from .launch import launch
    from .table import read_jsonl
    try:
        launched = launch(parse_scheme("ptdp:tp=1"), nproc=1, model=model, steps=args.steps,
                          seq_length=args.seq_length, out_dir=out_dir, global_batch=args.global_batch,
                          micro_batch=args.micro_batch, timeout=args.timeout)
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return [r["loss"] for r in read_jsonl(launched["log"]) if r.get("kind") == "train"]


def _progress(row: dict) -> str:
    if row["status"] != "ok":
        return f"[compare]   {row['link']} {row['scheme']}: FAILED: {row['error']}"
    pred = row.get("predicted", {})
    ptxt = f", predicted {pred['tokens_per_s']:,.0f}" if "tokens_per_s" in pred else ""
    link = row.get("link_bytes_per_step_per_node")
    return (f"[compare]   {row['link']} {row['scheme']}: {row['tokens_per_s']:,.0f} tokens/s{ptxt}, step "
            f"{row['step_s_median']:.3f} s, link {link or 0:,.0f} B/step/node, final loss {row['final_loss']:.4f}")
