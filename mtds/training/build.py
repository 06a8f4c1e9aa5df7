"""Phase 2 of a run, "build the run": logger, data, model, engine, for the job phase 1 admitted.

Everything later phases need is in the returned :class:`BuiltRun`; the run's DeepSpeed dict, batch, precision,
ZeRO stage and stage partition were settled once, by the admission (mtds.training.admit), and are read from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch.distributed as dist

from mtds.deepspeed_compat import check_engine
from mtds.model.documents import DocumentMasking
from mtds.pipe import build_model
from mtds.pipe.select import OWN_ENGINE
from mtds.safety.numerics import LocalNonFinite
from mtds.safety.startup import BuildLockWatchdog

from mtds.training.config import TrainConfig
from mtds.training.distributed import configure_matmul_precision
from mtds.training.ds_config import BatchPlan
from mtds.training.engine_setup import create_engine, install_engine_patches
from mtds.observe.logger import StepLogger
from mtds.training.stage_plan import describe
from mtds.training.world import World


@dataclass
class BuiltRun:
    """A run ready to train: what ``resume`` and ``train`` read."""

    cfg: TrainConfig
    world: World
    ds_config: dict
    batch: BatchPlan
    precision: str                 # fp32 | bf16 | fp16, decided once from ds_config
    zero_stage: int                # 0-3, decided once from ds_config
    tf32: bool                     # fp32 on CUDA: matmuls on TF32 tensor cores
    logger: StepLogger
    stream: object                 # mtds.data.MicroBatchStream of the training data
    eval_stream: Callable          # () -> a fresh evaluation stream, or None without held-out data
    model: object                  # this rank's part of the model (PipelineModule for p > 1)
    engine: object                 # the DeepSpeed engine
    nonfinite: LocalNonFinite | None   # this rank's own non-finite gradients (None under fp16: the scaler)


def pipeline_transport(cfg: TrainConfig, world: World) -> dict:
    """The admitted DeepSpeed dict with the pipeline edits the model's stage outputs need."""
    layout, ds_config = world.layout, world.admitted.ds_config
    if layout.pp == 1:
        return ds_config
    dualpipev_tp = cfg.pipeline_schedule == "dualpipev" and layout.tp > 1
    whole = cfg.sequence_parallel or world.model_cfg.num_experts > 0 or dualpipev_tp
    # DeepSpeed's pipeline splits a stage's output over the TP ranks and the next stage all-gathers it
    # (scatter/gather, PTD-P Section 4.1): correct only for activations that are replicated across TP ranks.
    # Sequence-parallel activations are already one slice per rank. An MoE model's stage output also carries
    # the router statistics (mtds.model.router_carry), whose `probs` needs a gradient: DeepSpeed's scatter
    # asserts that only the first tensor does (an MoE model at t > 1, p > 1 without --sequence-parallel stopped
    # there); DeepSpeed's DualPipeVEngine refuses scatter/gather. Those outputs go whole (t x the p2p bytes).
    if not whole:
        return ds_config
    if dualpipev_tp and dist.get_rank() == 0:
        print("dualpipev: DeepSpeed's DualPipeVEngine refuses scatter/gather; stage outputs go whole", flush=True)
    return {**ds_config, "pipeline": {**ds_config.get("pipeline", {}), "pipe_partitioned": False,
                                      "grad_partitioned": False}}


def build_data(cfg: TrainConfig, world: World, batch: BatchPlan, logger: StepLogger):
    """The training stream and a factory of evaluation streams (--data or --data-path: mtds.data.build_streams);
    each rank reads only what its stages need."""
    from mtds.data import build_streams
    return build_streams(cfg, world.model_cfg, batch, world.groups, logger)


def document_masking(cfg: TrainConfig) -> DocumentMasking | None:
    """--reset-position-ids / --reset-attention-mask: documents end at the tokenizer's EOS."""
    if not (cfg.reset_position_ids or cfg.reset_attention_mask):
        return None
    from mtds.data import load_tokenizer
    return DocumentMasking(load_tokenizer(cfg.tokenizer).eos_token_id, reset_position_ids=cfg.reset_position_ids,
                           reset_attention_mask=cfg.reset_attention_mask)


def _documents_note(cfg: TrainConfig) -> str:
    resets = [what for what, on in (("positions restart", cfg.reset_position_ids),
                                    ("attention stays inside", cfg.reset_attention_mask)) if on]
    return f"; per packed document: {' and '.join(resets)}" if resets else ""


def build_run_model(cfg: TrainConfig, world: World, stage_layout=None, log=print):
    """This rank's stages (a PipelineModule for p > 1; ``stage_layout``: blocks per virtual stage), with
    recomputation, then HF weights if asked (``log``: the line saying what was loaded)."""
    model = build_model(world.model_cfg, world.groups, seed=cfg.seed, rng_tracker=world.rng,
                        sequence_parallel=cfg.sequence_parallel, documents=document_masking(cfg),
                        recompute_interval=cfg.recompute_interval if cfg.recompute == "full" else 0,
                        recompute_attention=cfg.recompute == "selective",
                        virtual_stages=cfg.virtual_stages if cfg.pipeline_schedule in OWN_ENGINE else None,
                        dualpipev=cfg.pipeline_schedule == "dualpipev", stage_layout=stage_layout,
                        cp_comm_type=cfg.cp_comm_type, carry_router_stats=True,
                        cross_entropy_impl=cfg.cross_entropy_fusion_impl if cfg.cross_entropy_loss_fusion else None)
    if cfg.overlap_moe_expert_parallel_comm:
        from mtds.model.moe import MoEBlock
        for block in model.modules():
            if isinstance(block, MoEBlock):
                block.overlap_dispatch = True
    if cfg.init_from_hf:
        from mtds.hf.init import load_hf_into_stages, loaded_by_all   # HF interop; loads only this rank's shards
        tensors, params = loaded_by_all(load_hf_into_stages(model, cfg.init_from_hf, world.model_cfg, world.groups))
        log(f"init: {tensors} tensors, {params:,} parameters loaded from HF {cfg.init_from_hf}")
    if cfg.compile:
        from mtds.model.compile import compile_layers
        compile_layers(model)
    return model


def build_run(cfg: TrainConfig, world: World, watchdog: BuildLockWatchdog,
              on_engine_ready: Sequence[Callable] = ()) -> BuiltRun:
    """Config, logger, data, model, engine and its patches, then the probes; in this order on every rank."""
    admitted = world.admitted
    ds_config, batch, overrides = pipeline_transport(cfg, world), admitted.batch, admitted.overrides
    prec, zero = admitted.precision, admitted.zero_stage
    tf32 = configure_matmul_precision(world.device, prec)
    layout, groups = world.layout, world.groups

    # One rank reports: the last stage's first TP/DP rank sees the loss first-hand.
    reporting = groups.is_last_stage and groups.tp_rank == 0 and groups.dp_rank == 0 and groups.cp_rank == 0
    logger = StepLogger(enabled=reporting, total_steps=cfg.steps, append=bool(cfg.load), jsonl_path=cfg.log_jsonl,
                        tensorboard_dir=cfg.tensorboard, progress=cfg.progress)
    sp = " + sequence parallel" if cfg.sequence_parallel else ""
    sp += f" + context parallel ({cfg.cp_comm_type})" if layout.cp > 1 else ""
    sp += " + expert parallel (all-to-all)" if layout.ep > 1 else ""
    sp += f", {cfg.pipeline_schedule} schedule" if layout.pp > 1 else ""
    logger.info(f"mtds: layout {layout}{sp} on {world.size} {world.device.type} rank(s) [{world.backend}], {prec}"
                f"{' (TF32 matmuls)' if tf32 else ''}, "
                f"ZeRO-{zero}; global batch {batch.global_batch} = micro {batch.micro_batch} x "
                f"accumulation {batch.accumulation} x dp {layout.dp}")
    if overrides:
        logger.info(f"flags over the DeepSpeed config: {', '.join(overrides)}")
    if world.allocator:
        logger.info(f"cpu: {world.allocator}")

    stream, eval_stream = build_data(cfg, world, batch, logger)
    stage_layout = admitted.stage_layout
    if stage_layout is not None:
        logger.info(describe(cfg, world.model_cfg, layout, batch, prec, zero, stage_layout))
    model = build_run_model(cfg, world, stage_layout, log=logger.info)
    engine = create_engine(cfg, world, model, ds_config, batch)
    watchdog.stop()     # JIT builds happen while DeepSpeed starts, not later
    install_engine_patches(engine, cfg, world, prec, zero)
    if cfg.overlap_moe_expert_parallel_comm and cfg.pipeline_schedule == "dualpipev":
        # one phase's forward beside the other's backward, on two threads (rules: experts.dualpipev_overlap)
        from mtds.pipe.dualpipev_overlap import install_cross_chunk_overlap
        install_cross_chunk_overlap(engine, world.groups, world.tracer, cfg.dist_timeout_s)
    check_engine(engine)   # attributes DeepSpeed creates in __init__ that mtds reads or sets
    for probe in on_engine_ready:
        probe(engine, groups)
    # After the probes: their gradient hooks (tests inject NaNs so) run before this rank's record.
    nonfinite = LocalNonFinite(engine.module, getattr(engine, "mtds_flat_bf16", None),
                               engine.__dict__.get("mtds_zero1_reduce")) if prec != "fp16" else None

    n_params = sum(p.numel() for p in model.parameters())
    mc = world.model_cfg
    logger.info(f"model: {mc.num_layers} layers, hidden {mc.hidden_size}, heads {mc.num_heads}, vocab "
                f"{mc.vocab_size}; {n_params:,} parameters on the reporting rank{_documents_note(cfg)}")
    return BuiltRun(cfg=cfg, world=world, ds_config=ds_config, batch=batch, precision=prec, zero_stage=zero,
                    tf32=tf32, logger=logger, stream=stream, eval_stream=eval_stream, model=model, engine=engine,
                    nonfinite=nonfinite)
