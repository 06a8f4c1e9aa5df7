"""The planner's prediction for one measured cell: mtds.plan.predict with this machine's calibrated
device profile (``mtds-plan --calibrate``) as the "GPU", the cluster's ranks per node as GPUs per node,
and the shaped inter-node link as the inter-node bandwidth. Nothing is tuned per cell: one profile,
one link rate per column. The emulated cluster's nodes all run on this host: the profile is measured
with that many ranks at once (compute contention), and the prediction models what the run does --
the pipeline partition it builds, how its ZeRO-1 reduces gradients."""
from __future__ import annotations

import os

from .schemes import Scheme


def calibrate(path: str, threads_per_rank: int = 1, world_size: int = 2) -> str:
    """Measure this machine (GEMM curve, element-wise rates, optimizer step, all-reduce) into a profile
    at `path`, with `world_size` ranks measuring at once (the ranks the runs will put on this host)."""
    from mtds.plan.calibrate import run_calibration, save_profile
    return str(save_profile(run_calibration(world_size=world_size, threads_per_rank=threads_per_rank, engine=True),
                            path))


def run_partition(spec, layout, work, world: int, ranks_per_node: int, balance: str | None):
    """The pipeline partition train.py builds for this cell (mtds.training.stage_plan's rule: uniform, or
    the cost model on the planner's reference GPU with this host's memory per rank); None without a pipeline."""
    if layout.pp == 1:
        return None
    from mtds.plan.balance import run_partition
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return run_partition(spec, layout, work, world, balance, capacity_bytes=ram / ranks_per_node)


def predict_cell(scheme: Scheme, *, model: str, seq: int, global_batch: int, micro_batch: int, world: int,
                 ranks_per_node: int, link_bytes_per_s: float | None, profile: str,
                 ranks_per_host: int | None = None, balance: str | None = None,
                 grad_reduce: str | None = None) -> dict:
    """Predicted step time (s), tokens/s and the planner's time breakdown; {"error": ...} when the
    planner cannot model the scheme. ranks_per_host: ranks sharing this host's cores (default: all of
    them, the emulated cluster); balance: the run's --pipeline-balance (None: train.py's default);
    grad_reduce: its ZeRO-1 gradient reduction (None: the scheme's)."""
    from mtds.plan.candidate import Candidate, Workload
    from mtds.plan.hardware import Cluster, get_gpu
    from mtds.plan.model_spec import resolve_model
    from mtds.plan.predict import predict
    if scheme.kind == "autotp":
        return {"error": "the planner models Megatron TP, not AutoTP"}
    if scheme.kind == "torchtitan" and scheme.tp > 1:
        return {"error": "the planner models ZeRO-3 without TP, not FSDP2 x TP"}
    gpu = get_gpu("local", profile=profile)
    spec = resolve_model(model, seq=seq)
    layout = Candidate(scheme.tp, scheme.pp, scheme.data_parallel(world), micro_batch, zero_stage=scheme.zero_stage,
                    recompute="none", sequence_parallel=bool(scheme.sp), pipeline_schedule=scheme.schedule,
                    virtual_stages=2 if scheme.schedule == "dualpipev" else scheme.v, cp=scheme.cp,
                    cp_comm_type=scheme.comm,
                    # Megatron-core's pipeline sends the whole activation from every TP rank (twice mtds's link
                    # bytes at t = 2 on the emulated nodes); mtds sends 1/t and gathers
                    pipeline_scatter_gather=scheme.kind != "megatron")
    cluster = Cluster(gpu, world, gpus_per_node=ranks_per_node,
                      inter_gbps=link_bytes_per_s / 1e9 if link_bytes_per_s else None,
                      ranks_per_host=ranks_per_host or world)
    work = Workload(global_batch, precision="fp32")
    stages = run_partition(spec, layout, work, world, ranks_per_node, balance)
    if scheme.kind == "megatron" and not grad_reduce:
        # its distributed optimizer reduce-scatters the gradients with torch's reduce_scatter_tensor, which gloo (the
        # peers' backend, compare/peer_entry.py) runs as an all-reduce: all-reduce + all-gather of the parameters,
        # 1.5x the ring reduce-scatter's bytes (17.46 MB a step per node at (2,1,2) on llama-tiny, as counted)
        grad_reduce = "all-reduce"
    pred = predict(spec, layout, work, cluster, stages=stages, zero1_grad_reduce=grad_reduce or scheme.grad_reduce)
    out = {"step_s": pred.step_time_s, "tokens_per_s": global_batch * seq / pred.step_time_s,
           "breakdown_s": pred.time_breakdown_s, "profile": os.path.abspath(profile)}
    if stages is not None:
        out["stages"] = list(stages.blocks)
    return out
