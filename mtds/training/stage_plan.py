"""Which transformer blocks each pipeline (virtual) stage of this run holds: ``--pipeline-layout``
as written, else ``--pipeline-balance`` (uniform: DeepSpeed's even split of the blocks; cost: the
planner's per-layer cost model, mtds.plan.balance)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mtds.parallel.pipeline_layout import StageLayout, parse_layout, uniform_layout
from mtds.plan.balance import DEFAULT_BALANCE, REFERENCE_GPU


def device_memory_bytes(device: torch.device) -> float:
    """What one rank may use: the GPU's memory, or this node's RAM shared by its ranks."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(1, ranks_here)


def planner_view(cfg, model_cfg, layout, batch, precision: str, zero_stage: int):
    """(ModelSpec, Candidate, Workload, Cluster) of this run, as mtds.plan sees it."""
    from mtds.plan import Cluster, Candidate, ModelSpec, Workload, get_gpu
    spec = ModelSpec.from_config(model_cfg, seq=cfg.seq_length)
    plan_layout = Candidate.of_layout(layout, microbatch=batch.micro_batch, zero_stage=zero_stage,
                                      recompute=cfg.recompute, sequence_parallel=cfg.sequence_parallel,
                                      pipeline_schedule=cfg.pipeline_schedule, cp_comm_type=cfg.cp_comm_type,
                                      zero2_pipeline_reduce=cfg.zero2_pipeline_reduce,
                                      zero3_pipeline_gather=cfg.zero3_pipeline_gather)
    work = Workload(global_batch=batch.global_batch, precision=precision)
    return spec, plan_layout, work, Cluster(get_gpu(REFERENCE_GPU, precision), gpus=layout.world_size)


def resolve_stage_layout(cfg, model_cfg, layout, batch, precision: str, zero_stage: int,
                         device: torch.device) -> StageLayout | None:
    """This run's partition (None without a pipeline). With ``cost``, rank 0 decides (device memory
    is the constraint and could differ between ranks) and every rank builds what it decided."""
    if layout.pp == 1:
        return None
    stages = layout.pp * layout.vp
    if cfg.pipeline_layout:
        return parse_layout(cfg.pipeline_layout, stages=stages, num_layers=model_cfg.num_layers)
    if (cfg.pipeline_balance or DEFAULT_BALANCE) == "uniform":
        return uniform_layout(model_cfg.num_layers, stages)
    from mtds.plan.balance import run_partition
    decided = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        spec, plan_layout, work, _ = planner_view(cfg, model_cfg, layout, batch, precision, zero_stage)
        decided[0] = run_partition(spec, plan_layout, work, layout.world_size, cfg.pipeline_balance,
                                   device_memory_bytes(device)).blocks
    if dist.is_initialized():
        dist.broadcast_object_list(decided, src=0)
    return StageLayout(tuple(decided[0]))


def describe(cfg, model_cfg, layout, batch, precision: str, zero_stage: int, stages: StageLayout) -> str:
    """One log line: the layout and the planner's per-stage cost of it (critical rank marked)."""
    from mtds.plan.balance import stage_report
    report = stage_report(*planner_view(cfg, model_cfg, layout, batch, precision, zero_stage), stages)
    how = "--pipeline-layout" if cfg.pipeline_layout else f"--pipeline-balance {cfg.pipeline_balance or DEFAULT_BALANCE}"
    per_rank = ", ".join(f"{x / report.critical_s:.2f}" for x in report.rank_s)
    return (f"pipeline layout {stages} ({how}); planner's per-rank compute relative to the critical rank "
            f"{report.critical_rank}: {per_rank}")
