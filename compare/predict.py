"""The planner's prediction for one measured cell: mtds.plan.predict with this machine's calibrated
device profile (``mtds-plan --calibrate``) as the "GPU", the cluster's ranks per node as GPUs per node,
and the shaped inter-node link as the inter-node bandwidth. Nothing is tuned per cell: one profile,
one link rate per column."""
from __future__ import annotations

import os

from .schemes import Scheme


def calibrate(path: str, threads_per_rank: int = 1) -> str:
    """Measure this machine (GEMM curve, element-wise rates, all-reduce) into a profile at `path`."""
    from mtds.plan.calibrate import run_calibration, save_profile
    return str(save_profile(run_calibration(world_size=2, threads_per_rank=threads_per_rank), path))


def predict_cell(scheme: Scheme, *, model: str, seq: int, global_batch: int, micro_batch: int, world: int,
                 ranks_per_node: int, link_bytes_per_s: float | None, profile: str) -> dict:
    """Predicted step time (s), tokens/s and the planner's time breakdown; {"error": ...} when the
    planner cannot model the scheme."""
    from mtds.plan.candidate import Layout, Workload
    from mtds.plan.hardware import Cluster, get_gpu
    from mtds.plan.model_spec import resolve_model
    from mtds.plan.predict import predict
    if scheme.kind == "autotp":
        return {"error": "the planner models Megatron TP, not AutoTP"}
    gpu = get_gpu("local", profile=profile)
    spec = resolve_model(model, seq=seq)
    layout = Layout(scheme.tp, scheme.pp, scheme.data_parallel(world), micro_batch, zero_stage=scheme.zero_stage,
                    recompute="none", sequence_parallel=bool(scheme.sp), pipeline_schedule=scheme.schedule,
                    virtual_stages=2 if scheme.schedule == "dualpipev" else scheme.v)
    cluster = Cluster(gpu, world, gpus_per_node=ranks_per_node,
                      inter_gbps=link_bytes_per_s / 1e9 if link_bytes_per_s else None)
    pred = predict(spec, layout, Workload(global_batch, precision="fp32"), cluster)
    return {"step_s": pred.step_time_s, "tokens_per_s": global_batch * seq / pred.step_time_s,
            "breakdown_s": pred.time_breakdown_s, "profile": os.path.abspath(profile)}
