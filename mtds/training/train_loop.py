"""Phase 4 of a run, "train": the step loop. Each step: hooks' ``before_step``, one optimizer step, its
record, hooks' ``after_step`` (which may stop the run); then hooks' ``at_end`` and the closing of the log."""
from __future__ import annotations

import sys
import time

import torch

from mtds.observe.gemm_peak import cpu_gemm_peak
from mtds.observe.metrics import model_config_flops, peak_tflops
from mtds.model.stages import stage_modules
from mtds.safety.signals import StopRequest

from mtds.training.build import BuiltRun
from mtds.training.distributed import peak_memory_gib
from mtds.training.hooks import step_hooks
from mtds.training.result import RunResult
from mtds.training.step import train_step
from mtds.observe.ranges import profiler_range


CPU_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class StepRecorder:
    """Runs one optimizer step and measures it: the fields of the step's log record."""

    def __init__(self, built: BuiltRun):
        self.built = built
        cfg, world, batch = built.cfg, built.world, built.batch
        self.tokens_per_step = batch.global_batch * cfg.seq_length
        # FLOPs from the architecture (FFN width, SwiGLU, GQA): the planner's count, one function
        self.flops_model = model_config_flops(world.model_cfg, batch.global_batch, cfg.seq_length)
        self.flops_hw = model_config_flops(world.model_cfg, batch.global_batch, cfg.seq_length, recompute=cfg.recompute)
        device = world.device
        if device.type == "cuda":
            # fp32 on CUDA runs its matmuls on TF32 tensor cores: MFU against the TF32 peak
            self.peak = peak_tflops(torch.cuda.get_device_name(device), "tf32" if built.tf32 else built.precision)
        elif device.type == "cpu":
            # no datasheet: this rank's own matmul rate at its dtype and threads, measured once (ms)
            self.peak = cpu_gemm_peak(CPU_DTYPES[built.precision]) / 1e12
        else:
            self.peak = None

    def step(self, step: int) -> dict:
        b = self.built
        engine, stream, world = b.engine, b.stream, b.world
        skipped_before, lr = engine.skipped_steps, engine.get_lr()[0]
        start = time.perf_counter()
        consumed = stream.consumed_samples
        world.rng.begin_step(step)     # dropout masks keyed by (step, micro-batch, layer): schedule-independent
        loss = train_step(engine, stream, world.groups, b.batch.accumulation, world.device)
        elapsed = time.perf_counter() - start
        if stream.consumed_samples == consumed:
            # This rank read no data (a middle 1f1b stage; DualPipeV's last rank, which DeepSpeed never
            # loads on): move its position anyway, so every rank saves where the data stream is -- a
            # resume under another schedule or layout may make this rank read labels.
            stream.consumed_samples += b.batch.global_batch
        grad_norm = engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else None
        scale = getattr(engine.optimizer, "loss_scale", None) or getattr(engine.optimizer, "cur_scale", None)
        tflops_model = self.flops_model / elapsed / world.size / 1e12
        allocated, reserved = peak_memory_gib(world.device)
        return {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "loss_scale": float(scale) if scale is not None else 1.0, "skipped": engine.skipped_steps > skipped_before,
            "tokens_per_s": self.tokens_per_step / elapsed, "tflops_model": tflops_model,
            "tflops_hw": self.flops_hw / elapsed / world.size / 1e12,
            "mfu": tflops_model / self.peak if self.peak else None,
            "peak_mem_gib": allocated, "peak_reserved_gib": reserved, "step_time_s": elapsed,
            "comm_bytes": None,                         # the tracer's hook fills it in
            "consumed_samples": stream.consumed_samples,
        }


def train(built: BuiltRun, start_step: int, stop: StopRequest) -> RunResult:
    """Steps ``start_step + 1 .. --steps`` with the run's hooks; the RunResult every rank returns."""
    cfg = built.cfg
    result = RunResult(layout=str(built.world.layout), final_step=start_step,
                       params=sum(p.numel() for p in built.engine.module.parameters() if p.requires_grad),
                       layers=sorted(stage_modules(built.model, built.world.model_cfg)))
    recorder = StepRecorder(built)
    hooks = step_hooks(built, result, stop, start_step)
    hook_ranges = [f"mtds.hook.{type(hook).__name__}" for hook in hooks]     # profiler range names, made once
    for step in range(start_step + 1, cfg.steps + 1):
        for hook in hooks:
            hook.before_step(step)
        with profiler_range("mtds.step"):
            record = recorder.step(step)
        result.losses.append(record["loss"])
        result.grad_norms.append(record["grad_norm"])
        result.skipped.append(record["skipped"])
        result.final_step = step
        reasons = []
        for hook, name in zip(hooks, hook_ranges):   # every hook sees every step
            with profiler_range(name):
                reasons.append(hook.after_step(step, record))
        result.stopped_by = next((r for r in reasons if r), None)
        if result.stopped_by:
            break

    completed = cfg.steps > start_step and not result.stopped_by
    for hook in hooks:
        hook.at_end(result.final_step, completed)
    built.logger.close(plot_path=cfg.plot, title=f"{built.world.layout} {built.precision} ZeRO-{built.zero_stage}")
    if built.world.tracer is not None:
        built.world.tracer.uninstall()
    sys.stdout.flush()
    return result
