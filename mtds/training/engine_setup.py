"""The DeepSpeed engine of a run, and what mtds installs on it before the first step.

``create_engine`` picks the engine (DeepSpeed's own, or mtds's ``ScheduledPipelineEngine`` for the
interleaved / zero-bubble schedules) with the LR schedule; ``install_engine_patches`` then adds the
gradient fixes a layout needs. Both run on every rank, in this order, before any step.
"""
from __future__ import annotations

from typing import Callable

from mtds.observe.comm_trace import label_deepspeed_groups
from mtds.deepspeed_compat import pipeline as ds_pipeline
from mtds.deepspeed_compat.bf16_flat import install_flat_bf16
from mtds.deepspeed_compat.expert_checkpoint import EXPERT_GROUPS, install_expert_checkpointing
from mtds.deepspeed_compat.expert_groups import create_expert_groups, expert_groups_module, mark_expert_parameters
from mtds.model.experts import expert_parallel_parameters
from mtds.deepspeed_compat.bf16_reduce import install_bf16_reduce_scatter
from mtds.deepspeed_compat.bf16_zero2 import install_bf16_zero2
from mtds.deepspeed_compat.zero1_reduce import install_reduce_scatter, reduce_early
from mtds.deepspeed_compat.zero2_reduce import install_zero2_reduce_scatter, micro_batch_done
from mtds.deepspeed_compat.zero3_params import (
    free_parameters, gather_parameters, install_stage_parameter_shards, parameters_received, prefetch_parameters)
from mtds.deepspeed_compat.stage_expert_norms import install_stage_expert_norms
from mtds.deepspeed_compat.zero_norm import install_foreach_norm
from mtds.deepspeed_compat.zero_repoint import install_skip_repoint
from mtds.parallel.dp_reduce import reduce_scatter_sum, split_by_spans
from mtds.tp.mappings import all_gather_single
from mtds.pipe.select import OWN_ENGINE

from mtds.training.config import TrainConfig
from mtds.training.ds_config import BatchPlan
from mtds.training.grad_norm import install_fp32_clipping, mark_sharded_gradients
from mtds.training.schedule import build_scheduler
from mtds.training.sequence_grad_hook import defer_sequence_parallel_grads
from mtds.training.world import World



def _lr_scheduler(cfg: TrainConfig, ds_config: dict) -> Callable | None:
    """mtds's warm-up + decay unless the DeepSpeed config brings its own scheduler."""
    if "scheduler" in ds_config or "optimizer" not in ds_config:
        return None
    base_lr = ds_config["optimizer"]["params"].get("lr", 1e-3)
    return lambda opt: build_scheduler(opt, base_lr=base_lr, min_lr=cfg.min_lr, warmup=cfg.warmup_steps,
                                       total=cfg.steps, decay=cfg.lr_decay)


def create_engine(cfg: TrainConfig, world: World, model, ds_config: dict, batch: BatchPlan):
    """``deepspeed.initialize`` (or ``build_scheduled_engine``) on this rank's part of the model."""
    import deepspeed

    from mtds.deepspeed_compat.lazy_compile import defer_compile_decorators
    defer_compile_decorators()      # before the ZeRO optimizer imports Muon's compiled functions
    scheduler = _lr_scheduler(cfg, ds_config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if world.layout.ep > 1:        # DeepSpeed's own expert handling (mtds.deepspeed_compat.expert_groups)
        create_expert_groups(world.layout, world.groups)
        experts = expert_parallel_parameters(model)
        mark_expert_parameters(experts, world.layout.ep)
        if experts:         # this pipeline stage holds MoE blocks
            named = {n: p for n, p in model.named_parameters() if getattr(p, "expert_parallel", False)}
            model.add_module(EXPERT_GROUPS, expert_groups_module(world.model_cfg.num_experts, world.layout, named))
    layout, groups = world.layout, world.groups
    if layout.pp > 1:
        ds_config = zero2_built_as_stage1(ds_config)
    if cfg.pipeline_schedule in OWN_ENGINE:
        from mtds.pipe.engine import build_scheduled_engine
        from mtds.model import documents, router_carry
        hidden_len = cfg.seq_length // layout.cp // (layout.tp if cfg.sequence_parallel else 1)
        num_experts = world.model_cfg.num_experts
        # beside the activation: an MoE model's router statistics, then the packed documents' segment ids
        beside = router_carry.beside(num_experts) if num_experts else ()
        if cfg.reset_position_ids or cfg.reset_attention_mask:
            beside += documents.beside(batch.micro_batch, cfg.seq_length // layout.cp)
        engine = build_scheduled_engine(model, config=ds_config, model_parameters=trainable, lr_scheduler=scheduler,
                                        schedule=cfg.pipeline_schedule, groups=groups,
                                        boundary_shape=(batch.micro_batch, hidden_len, world.model_cfg.hidden_size),
                                        beside=beside)
        if world.tracer is not None:
            for group in engine.p2p_groups.values():   # the engine's own p2p groups, over the pipeline's ranks
                world.tracer.name_group(group, "pp")
        return engine
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config,
                                           mpu=None if layout.pp > 1 else groups, lr_scheduler=scheduler)
    return engine


def zero2_built_as_stage1(ds_config: dict) -> dict:
    """ZeRO-2/3 on a pipeline: DeepSpeed's optimizer at stage 1 (its pipeline engine asserts stage < 2), the
    gradients partitioned by mtds (mtds.deepspeed_compat.zero2_reduce), ZeRO-3's parameters too
    (mtds.deepspeed_compat.zero3_params)."""
    zero = ds_config.get("zero_optimization") or {}
    if zero.get("stage") not in (2, 3):
        return ds_config
    return {**ds_config, "zero_optimization": {**zero, "stage": 1}}


def _late_params(engine):
    """The parameters whose gradients change after a stage's last backward: the tied weights (summed across
    stages after that) and the sequence-parallel weights (summed over TP)."""
    def late_params():
        deferred = [p for p in engine.module.parameters() if getattr(p, "sequence_parallel_grads_deferred", False)]
        return ds_pipeline.tied_parameters(engine.module) + deferred
    return late_params


def install_zero2_pipeline(engine, cfg: TrainConfig, zero_stage: int = 2) -> None:
    """ZeRO-2 at p > 1 (mtds.deepspeed_compat.zero2_reduce): its reducer on the stage-1 optimizer; each
    micro-batch's reduction after the rank's last action of it (mtds's engine calls ``micro_batch_done``
    itself; DeepSpeed's 1F1B after each BackwardPass, DualPipeV after each of its phase 0), the rest early as
    ZeRO-1's. ZeRO-3 (mtds.deepspeed_compat.zero3_params): the same with ``--zero3-pipeline-gather``'s
    reduction, and the working parameters freed after the stage's last backward (``step``) or after each
    forward and backward (``micro-batch``)."""
    mode = cfg.zero3_pipeline_gather if zero_stage == 3 else cfg.zero2_pipeline_reduce
    install = install_bf16_zero2 if engine.using_bf16_optimizer else install_zero2_reduce_scatter
    reducer = install(engine, reduce_scatter_sum, split_by_spans, _late_params(engine), mode)
    if zero_stage == 3:
        install_zero3_pipeline(engine, reducer, mode, own_engine=cfg.pipeline_schedule in OWN_ENGINE)
    if cfg.pipeline_schedule not in OWN_ENGINE:
        def after_backward(kwargs):
            if kwargs.get("phase", 0) == 0:     # DualPipeV: phase 0's backward is a micro-batch's last here
                micro_batch_done(engine)
        ds_pipeline.after_backward(engine, after_backward)
        ds_pipeline.before_tied_reduction(engine, lambda: reduce_early(engine))


def install_zero3_pipeline(engine, reducer, mode: str, own_engine: bool) -> None:
    """ZeRO-3 at p > 1: the stage's parameters freed now, gathered at each forward; freed again after the
    stage's last backward (its early reduction) and, in the ``micro-batch`` mode, after every forward and
    backward pass, gathered for every backward pass (prefetched: issued before the pass's receive)."""
    install_stage_parameter_shards(engine, mode, all_gather_single)
    early = reducer.reduce_early

    def reduce_early_then_free():
        early()
        free_parameters(engine)
    reducer.reduce_early = reduce_early_then_free
    if mode == "micro-batch" and not own_engine:     # mtds's engines gather per pass themselves
        ds_pipeline.around_passes(engine, before=lambda: gather_parameters(engine),
                                  after=lambda: free_parameters(engine),
                                  before_receive=lambda: prefetch_parameters(engine),
                                  received=lambda: parameters_received(engine))


def install_zero1_reduce_scatter(engine, cfg: TrainConfig) -> None:
    """ZeRO-1's gradients reduce-scattered (DeepSpeed's all-reduce stays where that cannot apply). On a
    pipeline each stage starts reducing as soon as its last backward (or W) ends: mtds's engine calls
    ``reduce_early`` itself, DeepSpeed's are hooked at their ReduceTiedGrads instruction. Late: the tied
    weights (summed across stages after that) and the sequence-parallel weights (summed over TP).
    DeepSpeed's BF16_Optimizer (bf16 with fp32 accumulation) likewise, from its fp32 gradient buffer."""
    late_params = _late_params(engine)
    if (install_reduce_scatter(engine, reduce_scatter_sum, split_by_spans, late_params) is None and
            install_bf16_reduce_scatter(engine, reduce_scatter_sum, split_by_spans, late_params) is None):
        return
    if cfg.pp > 1 and cfg.pipeline_schedule not in OWN_ENGINE:
        ds_pipeline.before_tied_reduction(engine, lambda: reduce_early(engine))


def install_engine_patches(engine, cfg: TrainConfig, world: World, precision: str, zero_stage: int) -> None:
    """The gradient fixes this run's precision / ZeRO stage / layout need, then the tracer's group names."""
    groups = world.groups
    # With expert parallelism DeepSpeed's MoE paths run on the stages holding experts; mtds's ZeRO foreach norm
    # declines there, and must on every stage: a pipeline's stages share the norm's collectives over the
    # model-parallel group, which the two paths run differently. The ZeRO-1 reduce-scatters, fp32
    # (zero1_reduce.py) and BF16_Optimizer's (bf16_reduce.py), and the flat-bf16 bookkeeping (bf16_flat.py: its
    # dense norm sums over the model-parallel group as DeepSpeed's, the expert norms stay DeepSpeed's) take MoE
    # param groups; a stage without experts runs the expert groups' norm collectives empty (stage_expert_norms.py).
    experts = world.layout.ep > 1
    install_flat_bf16(engine)           # BF16_Optimizer's per-parameter loops on flat buffers (else nothing)
    if not experts:
        install_foreach_norm(engine)    # ZeRO-1/2's norm in one foreach (else nothing)
        install_skip_repoint(engine)    # ZeRO-1/2: parameters re-pointed after a step only if they moved
    if precision == "fp32" and zero_stage == 0:
        install_fp32_clipping(engine, groups)
    elif precision != "fp32" and zero_stage == 0 and world.layout.pp == 1:
        mark_sharded_gradients(engine, groups)   # DeepSpeed's unfused fp16/bf16 optimizer drops TP shards
    if zero_stage in (2, 3) and world.layout.pp > 1:
        install_zero2_pipeline(engine, cfg, zero_stage)
    elif zero_stage == 1 and cfg.zero1_grad_reduce == "reduce-scatter":
        install_zero1_reduce_scatter(engine, cfg)
    if cfg.sequence_parallel:
        defer_sequence_parallel_grads(engine, groups)
    if experts and world.layout.pp > 1 and zero_stage >= 1:
        install_stage_expert_norms(engine)      # a stage without MoE blocks runs the expert groups' norms empty
    if world.layout.ep > 1:     # checkpoints: mtds's stacked experts through DeepSpeed's MoE files
        install_expert_checkpointing(engine, EXPERT_GROUPS)
    if world.tracer is not None:
        label_deepspeed_groups(world.tracer, engine)   # the pipeline engine's own grid groups, tied weights
