"""Admission: the job train.py was asked to run, described once and judged by the rulebook (mtds.rules) before
anything is built -- no process group beyond the default one, no data, no model.

``admit`` reads the DeepSpeed config with the flags over it, describes the job (:func:`describe`), asks every
rule, then settles the layout, the DeepSpeed dict and the batch, and (p > 1) the stage partition, whose one
rule is asked once the partition is known. Every rank decides alike from the same description, so a refused
job is one ``error:`` line from the first rank (:class:`mtds.rules.JobRefused`). Without processes it is the
whole of start-up's judgement: tests ask it for a grid of jobs (tests/test_rules.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mtds.deepspeed_compat.capabilities import version as deepspeed_version
from mtds.model.config import ModelConfig
from mtds.parallel.layout import ParallelLayout
from mtds.parallel.pipeline_layout import StageLayout
from mtds.rules import PARTITION_RULES, check
from mtds.rules.job import TRAIN, Job
from mtds.training.config import TrainConfig
from mtds.training.ds_config import (BatchPlan, batch_values, load_ds_config, override_batch, override_from_flags,
                                     precision, prepare_ds_config, zero_stage)


@dataclass(frozen=True)
class Admitted:
    """A job the rulebook admitted, with what start-up settled for it."""

    job: Job
    layout: ParallelLayout
    ds_config: dict                 # the DeepSpeed dict for this layout (batch keys consistent)
    batch: BatchPlan
    overrides: tuple[str, ...]      # the flags that overrode the user's JSON, as the header names them
    precision: str                  # fp32 | bf16 | fp16
    zero_stage: int
    stage_layout: StageLayout | None   # blocks per virtual stage (None without a pipeline)


def user_ds_config(cfg: TrainConfig) -> tuple[dict, list[str]]:
    """The user's DeepSpeed config with Megatron's flags over it, and those flags as the header names them."""
    user = override_batch(load_ds_config(cfg.deepspeed_config), cfg.global_batch_size, cfg.micro_batch_size)
    return override_from_flags(user, bf16=cfg.bf16, fp16=cfg.fp16, clip_grad=cfg.clip_grad,
                               weight_decay=cfg.weight_decay)


def describe(cfg: TrainConfig, world_size: int, model_cfg: ModelConfig, ds_config: dict,
             version: str | None = None) -> Job:
    """The job as the rulebook sees it: ``cfg``'s layout and features over ``world_size`` ranks, ``ds_config``'s
    stage, precision and batch, the model's facts (``version``: the installed DeepSpeed's)."""
    group = cfg.tp * cfg.context_parallel_size * cfg.pp
    dp = world_size // group if world_size % group == 0 else 1     # else the grid rule refuses first
    B, b, m = batch_values(ds_config, dp)
    bf16 = ds_config.get("bf16", ds_config.get("bfloat16", {})) or {}
    zero = ds_config.get("zero_optimization", {}) or {}
    stage = zero_stage(ds_config)
    return Job(model=model_cfg.facts(), world_size=world_size, tp=cfg.tp, pp=cfg.pp, cp=cfg.context_parallel_size,
               ep=cfg.expert_model_parallel_size, virtual_stages=cfg.virtual_stages,
               pipeline_schedule=cfg.pipeline_schedule, sequence_parallel=cfg.sequence_parallel,
               cp_comm_type=cfg.cp_comm_type, seq_length=cfg.seq_length, zero_stage=stage,
               precision=precision(ds_config),
               both_precisions=bool(ds_config.get("fp16", {}).get("enabled") and bf16.get("enabled")),
               grad_accum_dtype=(ds_config.get("data_types") or {}).get("grad_accum_dtype"),
               global_batch=B, micro_batch=b, accumulation=m, pipeline_layout=cfg.pipeline_layout,
               reset_position_ids=cfg.reset_position_ids, reset_attention_mask=cfg.reset_attention_mask,
               compile=cfg.compile,
               bf16_immediate_grad_update=bool(bf16.get("enabled") and bf16.get("immediate_grad_update")),
               zero_overlap_comm=bool(zero.get("overlap_comm", stage == 3 and cfg.pp == 1)),   # p > 1: stage 1's default
               zero_offload=any((zero.get(k) or {}).get("device", "none") != "none"
                                for k in ("offload_optimizer", "offload_param")),
               deepspeed_version=version,
               moe_z_loss=cfg.moe_z_loss_coeff > 0, moe_capacity=cfg.moe_expert_capacity_factor is not None,
               moe_bias_update=cfg.moe_router_enable_expert_bias,
               moe_seq_aux=cfg.moe_router_load_balancing_type == "seq_aux_loss",
               moe_aux_coeff=cfg.moe_aux_loss_coeff > 0,
               moe_overlap_comm=cfg.overlap_moe_expert_parallel_comm,
               recompute=cfg.recompute != "none",
               save=bool(cfg.save), async_save=cfg.async_save, purpose=TRAIN)


def admit(cfg: TrainConfig, world_size: int, model_cfg: ModelConfig, device) -> Admitted:
    """Judge the job and settle it, or raise :class:`mtds.rules.JobRefused` (bad files and values:
    ConfigError and friends). ``device``: the torch device the ranks run on (its memory bounds the cost
    balancer's partition). With a process group, the partition is rank 0's (mtds.training.stage_plan)."""
    from mtds.training.stage_plan import resolve_stage_layout
    user, overrides = user_ds_config(cfg)
    job = describe(cfg, world_size, model_cfg, user, deepspeed_version())
    check(job)
    layout = ParallelLayout.for_world(world_size, tp=cfg.tp, pp=cfg.pp, vp=job.chunks, cp=job.cp, ep=job.ep)
    ds_config, batch = prepare_ds_config(user, layout, device_type=device.type, lr=cfg.lr)
    prec, zero = precision(ds_config), zero_stage(ds_config)
    stages = resolve_stage_layout(cfg, model_cfg, layout, batch, prec, zero, device)
    if stages is not None:
        job = dataclasses.replace(job, stage_blocks=stages.blocks)
        check(job, PARTITION_RULES)
    return Admitted(job=job, layout=layout, ds_config=ds_config, batch=batch, overrides=tuple(overrides),
                    precision=prec, zero_stage=zero, stage_layout=stages)
