"""``run(TrainConfig)``: set up layout, data, model and DeepSpeed engine, then train and report.

Order of set-up (each step needs the previous one):
  1. torch.distributed (+ the collective tracer, which must wrap functions before DeepSpeed caches them)
  2. layout (validated against world size and model), process groups, RNG streams
  3. data (rank 0 tokenizes into the cache first, the others then read it)
  4. model (PipelineModule for p > 1) and the DeepSpeed engine (ZeRO, precision, optimizer, scheduler)
  5. optional resume, then the step loop with logging, evaluation and checkpoints
"""
from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mtds.comm_trace import CommTracer, label_deepspeed_groups
from mtds.config import ModelConfig, resolve_model_config
from mtds.deepspeed_compat import check_engine, check_installed, verify_ran
from mtds.layout import ParallelGroups, ParallelLayout
from mtds.metrics import model_config_flops, peak_tflops
from mtds.pipe import build_model
from mtds.safety.heartbeat import Heartbeat
from mtds.safety.numerics import LocalNonFinite, check_finite
from mtds.safety.signals import StopRequest
from mtds.safety.startup import BuildLockWatchdog, rendezvous_error
from mtds.tp import seed_parallel_streams

from . import checkpoint as ckpt
from .config import TrainConfig
from .distributed import init_distributed
from .ds_config import BatchPlan, load_ds_config, precision, prepare_ds_config, zero_stage
from .grad_norm import install_fp32_clipping, mark_sharded_gradients
from .logger import StepLogger
from .schedule import build_scheduler
from .sequence_grads import defer_sequence_parallel_grads
from .steps import eval_loss, train_step


@dataclass
class RunResult:
    """What a run returns on every rank (tests compare these across layouts)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    comm: dict = field(default_factory=dict)          # bytes per collective/group, last step
    layout: str = ""
    final_step: int = 0
    stopped_by: str | None = None                     # SIGTERM / SIGINT when the run stopped early


def _peak_memory_gib(device: torch.device) -> float:
    """Peak bytes resident: CUDA allocator peak on GPU, peak RSS of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kib / 2 ** 20


def _build_data(cfg: TrainConfig, model_cfg: ModelConfig, batch: BatchPlan, groups: ParallelGroups, logger):
    from mtds.data import (MicroBatchStream, build_packed_dataset, build_train_eval, check_seq_length,
                           check_vocab, load_tokenizer)
    check_seq_length(cfg.seq_length, model_cfg.max_position_embeddings)
    tokenizer = load_tokenizer(cfg.tokenizer)
    check_vocab(tokenizer, model_cfg.vocab_size)

    def build(spec):
        return build_packed_dataset(spec, tokenizer, cfg.seq_length, text_column=cfg.text_column,
                                    num_proc=cfg.num_proc, show_progress=dist.get_rank() == 0)

    # Rank 0 fills the tokenization cache; the rest wait, then read it (no concurrent writers).
    if dist.get_rank() == 0:
        train_ds, eval_ds = build_train_eval(build, cfg.data, cfg.eval_data, cfg.eval_split, cfg.seed)
        dist.barrier()
    else:
        dist.barrier()
        train_ds, eval_ds = build_train_eval(build, cfg.data, cfg.eval_data, cfg.eval_split, cfg.seed)
    logger.info(f"data: {len(train_ds)} training samples of {cfg.seq_length + 1} tokens"
                + (f", {len(eval_ds)} held out" if eval_ds is not None else ""))
    needs = dict(need_inputs=groups.is_first_stage or groups.layout.pp == 1,
                 need_labels=groups.is_last_stage or groups.layout.pp == 1
                 or (groups.is_first_stage and cfg.pipeline_schedule == "dualpipev"))   # V: loss on rank 0
    stream = MicroBatchStream(train_ds, global_batch_size=batch.global_batch, micro_batch_size=batch.micro_batch,
                              dp_rank=groups.dp_rank, dp_size=groups.layout.dp, seed=cfg.seed, **needs)

    def eval_stream():
        if eval_ds is None:
            return None
        return MicroBatchStream(eval_ds, global_batch_size=batch.global_batch, micro_batch_size=batch.micro_batch,
                                dp_rank=groups.dp_rank, dp_size=groups.layout.dp, seed=cfg.seed, shuffle=False,
                                name="evaluation", **needs)

    eval_stream()  # fail now, not at the first evaluation, if the held-out set is too small
    return stream, eval_stream


def run(cfg: TrainConfig) -> RunResult:
    # SIGTERM/SIGINT from here on end the run after the current step (with a checkpoint); a JIT build
    # lock left by a killed build ends start-up with an error instead of a silent hang.
    stop = StopRequest().install()
    heartbeat = Heartbeat(cfg.heartbeat_timeout_s)     # started once the process group exists
    error = None
    try:
        with BuildLockWatchdog(cfg.build_lock_timeout_s) as watchdog:
            return _run(cfg, stop, watchdog, heartbeat)
    except BaseException as err:     # the peers must not take a failed rank for a finished one
        error = err
        raise
    finally:
        heartbeat.stop(error)
        stop.uninstall()


def _run(cfg: TrainConfig, stop: StopRequest, watchdog: BuildLockWatchdog, heartbeat: Heartbeat) -> RunResult:
    check_installed()   # the DeepSpeed internals mtds relies on, before anything starts
    # The tracer wraps torch.distributed before DeepSpeed starts and caches the collectives it uses.
    tracer = CommTracer().install() if cfg.trace_comm else None
    try:
        device, backend = init_distributed(cfg.dist_timeout_s)
    except RuntimeError as err:     # torch's DistStoreError and timeouts while the ranks gather
        raise rendezvous_error(err, cfg.dist_timeout_s) from None
    heartbeat.start()
    world = dist.get_world_size()

    from mtds.pipe.select import OWN_ENGINE
    dualpipev = cfg.pipeline_schedule == "dualpipev"   # DeepSpeed's DualPipeVEngine: two chunks per rank
    own_schedule = cfg.pipeline_schedule in OWN_ENGINE  # mtds's ScheduledPipelineEngine
    layout = ParallelLayout.for_world(world, tp=cfg.tp, pp=cfg.pp, vp=2 if dualpipev else cfg.virtual_stages)
    model_cfg = resolve_model_config(cfg.model, **cfg.model_overrides)
    layout.check_model(num_heads=model_cfg.num_heads, num_kv_heads=model_cfg.kv_heads,
                       hidden_size=model_cfg.hidden_size, ffn_hidden_size=model_cfg.ffn_size,
                       num_layers=model_cfg.num_layers)
    if cfg.sequence_parallel:
        layout.check_sequence_parallel(cfg.seq_length)
    ds_config, batch = prepare_ds_config(load_ds_config(cfg.deepspeed_config), layout, device_type=device.type,
                                         lr=cfg.lr)
    if cfg.sequence_parallel and layout.pp > 1:
        # DeepSpeed's pipeline splits a stage's output over the TP ranks and the next stage
        # all-gathers it (scatter/gather, PTD-P Section 4.1): correct only for activations that are
        # replicated across TP ranks. Sequence-parallel activations are already one slice per rank.
        ds_config["pipeline"] = {**ds_config.get("pipeline", {}), "pipe_partitioned": False,
                                 "grad_partitioned": False}
    if dualpipev and layout.tp > 1:
        logger_line = "dualpipev: DeepSpeed's DualPipeVEngine refuses scatter/gather; stage outputs go whole"
        if dist.get_rank() == 0:
            print(logger_line, flush=True)
        ds_config["pipeline"] = {**ds_config.get("pipeline", {}), "pipe_partitioned": False,
                                 "grad_partitioned": False}
    if own_schedule or dualpipev:
        from mtds.pipe.select import check_schedule, check_schedule_config, deepspeed_version_problem
        check_schedule(cfg.pipeline_schedule, pp=layout.pp, virtual_stages=cfg.virtual_stages,
                       micro_batches=batch.accumulation)
        check_schedule_config(cfg.pipeline_schedule, ds_config)
        import deepspeed
        if problem := deepspeed_version_problem(deepspeed.__version__):
            raise ValueError(problem)
    groups = layout.build_groups(timeout_s=cfg.dist_timeout_s)
    if tracer is not None:
        for name in ("tp", "dp", "pp", "mp"):
            tracer.name_group(getattr(groups, f"{name}_group"), name)
    tracker = seed_parallel_streams(cfg.seed, groups, device)   # dropout streams, keyed per layer forward

    # One rank reports: the last stage's first TP/DP rank sees the loss first-hand.
    reporting = groups.is_last_stage and groups.tp_rank == 0 and groups.dp_rank == 0
    logger = StepLogger(enabled=reporting, total_steps=cfg.steps, append=bool(cfg.load), jsonl_path=cfg.log_jsonl,
                        tensorboard_dir=cfg.tensorboard, progress=cfg.progress)
    sp = " + sequence parallel" if cfg.sequence_parallel else ""
    sp += f", {cfg.pipeline_schedule} schedule" if layout.pp > 1 else ""
    logger.info(f"mtds: layout {layout}{sp} on {world} {device.type} rank(s) [{backend}], {precision(ds_config)}, "
                f"ZeRO-{zero_stage(ds_config)}; global batch {batch.global_batch} = micro {batch.micro_batch} x "
                f"accumulation {batch.accumulation} x dp {layout.dp}")

    stream, eval_stream = _build_data(cfg, model_cfg, batch, groups, logger)

    model = build_model(model_cfg, groups, seed=cfg.seed, rng_tracker=tracker, sequence_parallel=cfg.sequence_parallel,
                        recompute_interval=cfg.activation_checkpointing,
                        recompute_attention=cfg.recompute == "selective",
                        virtual_stages=cfg.virtual_stages if own_schedule else None, dualpipev=dualpipev)
    if cfg.init_from_hf:
        from mtds.hf.init import load_hf_into_stages   # HF interop; loads only this rank's shards
        load_hf_into_stages(model, cfg.init_from_hf, model_cfg, groups)

    import deepspeed
    scheduler = None
    if "scheduler" not in ds_config and "optimizer" in ds_config:
        base_lr = ds_config["optimizer"]["params"].get("lr", 1e-3)
        scheduler = lambda opt: build_scheduler(opt, base_lr=base_lr, min_lr=cfg.min_lr,  # noqa: E731
                                                warmup=cfg.warmup_steps, total=cfg.steps, decay=cfg.lr_decay)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if own_schedule:
        from mtds.pipe.engine import build_scheduled_engine
        hidden_len = cfg.seq_length // layout.tp if cfg.sequence_parallel else cfg.seq_length
        engine = build_scheduled_engine(model, config=ds_config, model_parameters=trainable, lr_scheduler=scheduler,
                                        schedule=cfg.pipeline_schedule, groups=groups,
                                        boundary_shape=(batch.micro_batch, hidden_len, model_cfg.hidden_size))
        if tracer is not None:
            tracer.name_group(engine.grad_group, "pp")
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config,
                                               mpu=None if layout.pp > 1 else groups, lr_scheduler=scheduler)
    watchdog.stop()     # JIT builds happen while DeepSpeed starts, not later
    if precision(ds_config) == "fp32" and zero_stage(ds_config) == 0:
        install_fp32_clipping(engine, groups)
    elif precision(ds_config) != "fp32" and zero_stage(ds_config) == 0 and layout.pp == 1:
        mark_sharded_gradients(engine, groups)   # DeepSpeed's unfused fp16/bf16 optimizer drops TP shards
    if cfg.sequence_parallel:
        defer_sequence_parallel_grads(engine, groups)
    if tracer is not None:
        label_deepspeed_groups(tracer, engine)   # the pipeline engine's own grid groups, tied weights
    check_engine(engine)   # attributes DeepSpeed creates in __init__ that mtds reads or sets
    for callback in cfg.on_engine_ready:
        callback(engine, groups)
    # After the callbacks: their gradient hooks (tests inject NaNs so) run before this rank's record.
    nonfinite = LocalNonFinite(engine.module) if precision(ds_config) != "fp16" else None

    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"model: {model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, heads "
                f"{model_cfg.num_heads}, vocab {model_cfg.vocab_size}; {n_params:,} parameters on the reporting rank")

    start_step = 0
    if cfg.load:
        start_step, state = ckpt.load(engine, cfg.load, groups, model_cfg=model_cfg, rng_tracker=tracker,
                                      log=logger.info)
        if "data" in state:   # weights-only checkpoints (mtds-convert hf-to-mtds) start the data afresh
            stream.load_state_dict(state["data"])
        logger.start_at(start_step)
        logger.info(f"resumed from {cfg.load} at step {start_step} ({stream.consumed_samples} samples consumed)")

    result = RunResult(layout=str(layout), final_step=start_step)
    tokens_per_step = batch.global_batch * cfg.seq_length
    # FLOPs from the architecture (FFN width, SwiGLU, GQA): the planner's count, one function
    flops_model = model_config_flops(model_cfg, batch.global_batch, cfg.seq_length)
    flops_hw = model_config_flops(model_cfg, batch.global_batch, cfg.seq_length, recompute=cfg.recompute)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = peak_tflops(device_name, precision(ds_config)) if device_name else None

    def evaluate(step: int) -> None:
        es = eval_stream()
        if es is None:
            return
        loss = eval_loss(engine, es, groups, batch.accumulation, cfg.eval_iters, device)
        result.eval_losses.append((step, loss))
        logger.log({"step": step, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}, kind="eval")

    def save(step: int) -> None:
        ckpt.save(engine, cfg.save, step, {"data": stream.state_dict()}, groups, model_cfg=model_cfg,
                  tokenizer=cfg.tokenizer, rng_tracker=tracker, keep_last=cfg.keep_last)

    timeline = None
    if cfg.timeline and layout.pp > 1:
        from mtds.pipe.instrument import StepTimeline
        timeline = StepTimeline(engine, groups, cfg.timeline)
    for step in range(start_step + 1, cfg.steps + 1):
        if tracer is not None:
            tracer.reset()
        if timeline is not None:
            timeline.begin()
        skipped_before, lr = engine.skipped_steps, engine.get_lr()[0]
        start = time.perf_counter()
        consumed = stream.consumed_samples
        tracker.begin_step(step)     # dropout masks keyed by (step, micro-batch, layer): schedule-independent
        loss = train_step(engine, stream, groups, batch.accumulation, device)
        elapsed = time.perf_counter() - start
        if step == start_step + 1:
            verify_ran(engine, engine.module)   # every patch on DeepSpeed's objects ran: no silent fallback
        if stream.consumed_samples == consumed:
            # This rank read no data (a middle 1f1b stage; DualPipeV's last rank, which DeepSpeed never
            # loads on): move its position anyway, so every rank saves where the data stream is -- a
            # resume under another schedule or layout may make this rank read labels.
            stream.consumed_samples += batch.global_batch
        grad_norm = engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else None
        skipped = engine.skipped_steps > skipped_before
        scale = getattr(engine.optimizer, "loss_scale", None) or getattr(engine.optimizer, "cur_scale", None)
        tflops_model = flops_model / elapsed / world / 1e12
        record = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "loss_scale": float(scale) if scale is not None else 1.0, "skipped": skipped,
            "tokens_per_s": tokens_per_step / elapsed, "tflops_model": tflops_model,
            "tflops_hw": flops_hw / elapsed / world / 1e12, "mfu": tflops_model / peak if peak else None,
            "peak_mem_gib": _peak_memory_gib(device), "step_time_s": elapsed,
            "comm_bytes": tracer.total_bytes() if tracer is not None else None,
            "consumed_samples": stream.consumed_samples,
            **(timeline.end() if timeline is not None else {}),
        }
        logger.log(record)
        result.losses.append(loss)
        result.grad_norms.append(grad_norm)
        result.skipped.append(skipped)
        result.final_step = step
        if tracer is not None:
            result.comm = tracer.summary()
        local_bad = nonfinite.take() if nonfinite is not None else False     # this step's record, every step
        if precision(ds_config) != "fp16" and not (cfg.on_nan == "skip" and skipped):
            # fp16: the loss scaler skips overflowing steps itself. "skip" accepts a step only where
            # the engine did not apply it (ZeRO-1/2 check the norm); an applied NaN update always stops.
            check_finite(step, loss, grad_norm, device, local_bad=local_bad)
        if cfg.check_replicas_interval and step % cfg.check_replicas_interval == 0:
            from .consistency import check_replicas
            check_replicas(engine.module, groups)
        if cfg.eval_interval and step % cfg.eval_interval == 0:
            evaluate(step)
        saved_now = bool(cfg.save and cfg.save_interval and step % cfg.save_interval == 0)
        if saved_now:
            save(step)
        result.stopped_by = stop.agreed(device)
        if result.stopped_by:
            if cfg.save and cfg.save_on_signal and not saved_now:
                save(step)
            logger.info(f"stopped after step {step} on {result.stopped_by}"
                        + (f"; checkpoint in {cfg.save}" if cfg.save and (cfg.save_on_signal or saved_now) else ""))
            break

    if cfg.steps > start_step and not result.stopped_by:
        if not (cfg.eval_interval and cfg.steps % cfg.eval_interval == 0):
            evaluate(cfg.steps)
        if cfg.save and not (cfg.save_interval and cfg.steps % cfg.save_interval == 0):
            save(cfg.steps)
    if timeline is not None:
        timeline.write(title=f"{layout} {cfg.pipeline_schedule}, step {result.final_step}")
    logger.close(plot_path=cfg.plot, title=f"{layout} {precision(ds_config)} ZeRO-{zero_stage(ds_config)}")
    if tracer is not None:
        tracer.uninstall()
    sys.stdout.flush()
    return result
