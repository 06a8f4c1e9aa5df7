"""The mtds side: ``mtds.training.run`` — the real DeepSpeed engine — on every spawned rank.

Nothing in mtds is changed for the benchmark; ``LoopProbe`` (probe.py) only wraps a few names of
``mtds.training`` (build, train_loop) in this process to time steps and count every collective.
"""
from __future__ import annotations

from lab.measure import median, peak_rss_gib
from lab.run_probe import LoopProbe
from .workloads import Shape, ds_config


def train_mtds(shape_fields: dict, tp: int, pp: int, global_batch: int, steps: int, warmup: int, seed: int,
               log_jsonl: str | None = None, profile_step: int | None = None) -> dict:
    import torch.distributed as dist

    from mtds.training import TrainConfig, job

    shape = Shape(**shape_fields)
    probe = LoopProbe(warmup, profile_step).install()
    cfg = TrainConfig(deepspeed_config=ds_config(shape.micro_batch, global_batch), model=shape.model_config(),
                      tp=tp, pp=pp, seq_length=shape.seq, steps=steps, seed=seed, eval_split=0.0,
                      log_jsonl=log_jsonl, progress=False, lr_decay="constant")
    result = job.run(cfg)
    measured = probe.step_times[warmup:]
    return {
        "side": "mtds", "rank": dist.get_rank(), "world": dist.get_world_size(), "layout": result.layout,
        "losses": result.losses, "step_times_s": probe.step_times, "median_step_s": median(measured),
        "tokens_per_s": global_batch * shape.seq / median(measured), "phases_s": probe.phases_per_step(),
        "comm_last_step": probe.comm_per_step[-1] if probe.comm_per_step else {},
        "parameters": probe.parameters, "rss_before_model_gib": probe.rss_before_model_gib,
        "peak_rss_gib": peak_rss_gib(), "profile_ops": probe.profile.get("ops"),
    }
