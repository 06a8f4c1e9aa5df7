"""Step hooks: the per-step extras around a training step, one small interface, one list.

Every hook sees each step in the order of :func:`step_hooks`:

* ``before_step(step)`` just before the step runs;
* ``after_step(step, record)`` once the step's record (loss, grad norm, timings, ...) exists; a hook may
  add fields to ``record`` (hooks later in the list, the logger among them, see them) and may return a
  reason to stop after this step (a string, e.g. the signal's name);
* ``at_end(step, completed)`` after the last step, in list order (not when a hook raised): ``completed``
  when the run reached ``--steps`` (no early stop, at least one step run).

A new per-step feature is one class here and one line in :func:`step_hooks`.
"""
from __future__ import annotations

import math
import os
import time
from typing import Protocol

import torch
import torch.distributed as dist

from mtds.deepspeed_compat import verify_ran
from mtds.safety.numerics import StepFlags
from mtds.safety.signals import StopRequest

from mtds.checkpoint import lifecycle as ckpt
from mtds.training.build import BuiltRun
from mtds.training.result import RunResult
from mtds.training.step import eval_loss
from mtds.training.expert_bias import update_expert_biases
from mtds.training.expert_load import ExpertLoad
from mtds.model.gpt import moe_blocks


class StepHook(Protocol):
    def before_step(self, step: int) -> None: ...

    def after_step(self, step: int, record: dict) -> str | None: ...

    def at_end(self, step: int, completed: bool) -> None: ...


class Hook:
    """No-op defaults: a hook overrides only what it does."""

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int, record: dict) -> str | None:
        return None

    def at_end(self, step: int, completed: bool) -> None:
        pass


class PatchesRanHook(Hook):
    """After the first step of this run: every patch mtds installed on DeepSpeed's objects actually ran
    (a renamed DeepSpeed method would otherwise leave a patch silently unused)."""

    def __init__(self, engine, first_step: int):
        self.engine, self.first_step = engine, first_step

    def after_step(self, step, record):
        if step == self.first_step:
            verify_ran(self.engine, self.engine.module)


class CommTraceHook(Hook):
    """Bytes of this step's collectives: counters zeroed before the step, read after it."""

    def __init__(self, tracer, result: RunResult):
        self.tracer, self.result = tracer, result

    def before_step(self, step):
        self.tracer.reset()

    def after_step(self, step, record):
        record["comm_bytes"] = self.tracer.total_bytes()
        self.result.comm = self.tracer.summary()


class TimelineHook(Hook):
    """--timeline: the measured pipeline bubble in each record, the last step's trace files at the end."""

    def __init__(self, built: BuiltRun):
        from mtds.observe.pipe_instrument import StepTimeline
        self.built = built
        self.timeline = StepTimeline(built.engine, built.world.groups, built.cfg.timeline)

    def before_step(self, step):
        self.timeline.begin()

    def after_step(self, step, record):
        record.update(self.timeline.end())

    def at_end(self, step, completed):
        self.timeline.write(title=f"{self.built.world.layout} {self.built.cfg.pipeline_schedule}, step {step}")


class ProfileHook(Hook):
    """--profile-step N: that step under torch.profiler (CPU, and CUDA where the run is on a GPU), first of
    the hooks so that it holds exactly the step; its summary by kind of work (mtds.observe.step_profile) goes to the
    result and the console, the Chrome trace to --profile-trace (one file per rank)."""

    def __init__(self, built: BuiltRun, result: RunResult):
        self.built, self.result, self.prof, self.start = built, result, None, 0.0

    def before_step(self, step):
        if step != self.built.cfg.profile_step:
            return
        from torch.profiler import ProfilerActivity, profile
        cuda = self.built.world.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        self.prof.__enter__()
        self.start = time.perf_counter()

    def after_step(self, step, record):
        if self.prof is None:
            return None
        from mtds.observe.step_profile import format_summary, summarize
        device = self.built.world.device.type
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.start
        self.prof.__exit__(None, None, None)
        self.result.profile = summarize(self.prof, wall, device)
        trace = self.built.cfg.profile_trace
        if trace:
            root, ext = os.path.splitext(trace)
            self.prof.export_chrome_trace(f"{root}.rank{dist.get_rank()}{ext or '.json'}")
        self.built.logger.info(format_summary(self.result.profile, step))
        self.prof = None
        return None


class ExpertLoadHook(Hook):
    """An MoE model's tokens per expert this step into the record, before it is logged
    (:mod:`mtds.training.expert_load`)."""

    def __init__(self, load):
        self.load = load

    def before_step(self, step):
        self.load.reset()

    def after_step(self, step, record):
        record.update(self.load.fields())


class ExpertBiasHook(Hook):
    """Aux-loss-free balancing: each MoE block's expert bias moved after the step by the step's loads
    (:mod:`mtds.training.expert_bias`); before ExpertLoadHook resets the counts for the next step."""

    def __init__(self, blocks, rate: float, dp_group):
        self.blocks, self.rate, self.dp_group = blocks, rate, dp_group

    def after_step(self, step, record):
        update_expert_biases(self.blocks, self.rate, self.dp_group)


class StragglerHook(Hook):
    """--log-straggler: every --straggler-interval steps, each rank's mean step time split into compute and
    wait (mtds.observe.stragglers) gathered over the world; a rank slower than --straggler-factor x the median
    is named in the log, and the record (JSONL, TensorBoard) carries the slowest rank's ratio."""

    def __init__(self, built: BuiltRun, result: RunResult):
        from mtds.observe.comm_trace import clock
        self.built, self.result, self.clock = built, result, clock
        self.step_s = self.wait_s = 0.0
        self.steps, self.first, self.wait_at_start = 0, None, 0.0

    def before_step(self, step):
        self.wait_at_start = self.clock.seconds
        if self.first is None:
            self.first = step

    def after_step(self, step, record):
        self.step_s += record["step_time_s"]
        self.wait_s += self.clock.seconds - self.wait_at_start
        self.steps += 1
        if step % self.built.cfg.straggler_interval:
            return None
        from mtds.observe.stragglers import describe, find_stragglers
        mine = torch.tensor([self.step_s / self.steps, self.wait_s / self.steps], dtype=torch.float64,
                            device=self.built.world.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        step_s, wait_s = zip(*(t.tolist() for t in every))
        compute_s = [max(0.0, s - w) for s, w in zip(step_s, wait_s)]
        found = find_stragglers(compute_s, self.built.cfg.straggler_factor)
        median = sorted(compute_s)[len(compute_s) // 2]
        slowest = max(range(len(compute_s)), key=compute_s.__getitem__)
        record.update(straggler_slowest_rank=slowest, straggler_ratio=compute_s[slowest] / median if median else 1.0,
                      straggler_compute_s=compute_s[slowest], straggler_median_compute_s=median,
                      stragglers=[s.rank for s in found])
        self.result.stragglers.append((step, [s.rank for s in found]))
        if found:
            self.built.logger.info(describe(found, self.first, step, list(wait_s)))
        self.step_s = self.wait_s = 0.0
        self.steps, self.first = 0, None
        return None


class LogHook(Hook):
    """The step's record to the console, JSONL, TensorBoard and progress bar (reporting rank only)."""

    def __init__(self, logger):
        self.logger = logger

    def after_step(self, step, record):
        self.logger.log(record)


class NonFiniteHook(Hook):
    """A NaN/inf loss or grad norm stops the run (bf16/fp32), naming the step and the ranks whose own
    gradients were non-finite; before any evaluation or checkpoint of the step, so nothing poisoned is saved.

    The same collective also agrees on a stop signal (SIGTERM/SIGINT on any rank): one all-reduce and one
    host read per step for both (:class:`~mtds.safety.numerics.StepFlags`); ``SignalStopHook`` reads
    ``self.flags``. A signal that arrives after this point is agreed on after the next step."""

    def __init__(self, built: BuiltRun, stop: StopRequest):
        self.built, self.stop = built, stop
        self.flags: StepFlags | None = None

    def after_step(self, step, record):
        b = self.built
        local_bad = b.nonfinite.take_flag() if b.nonfinite is not None else None    # this step's, every step
        # fp16: the loss scaler skips overflowing steps itself. "skip" accepts a step only where the engine
        # did not apply it (ZeRO-1/2 check the norm); an applied NaN update always stops.
        check = b.precision != "fp16" and not (b.cfg.on_nan == "skip" and record["skipped"])
        self.flags = StepFlags.agree(record["loss"], record["grad_norm"], b.world.device, local_bad,
                                     signal=self.stop.received or 0, check=check)
        self.flags.raise_if_nonfinite(step, record["loss"], record["grad_norm"])


class ReplicaCheckHook(Hook):
    """--check-replicas N: TP-replicated and tied weights must be identical every N steps."""

    def __init__(self, built: BuiltRun):
        self.built = built

    def after_step(self, step, record):
        if step % self.built.cfg.check_replicas_interval == 0:
            from mtds.training.consistency import check_replicas
            check_replicas(self.built.engine.module, self.built.world.groups)


class EvalHook(Hook):
    """Held-out loss every --eval-interval steps, and at the end unless the last step had one."""

    def __init__(self, built: BuiltRun, result: RunResult):
        self.built, self.result = built, result
        self.evaluated_at = None

    def evaluate(self, step: int) -> None:
        b = self.built
        self.evaluated_at = step
        es = b.eval_stream()
        if es is None:
            return
        loss = eval_loss(b.engine, es, b.world.groups, b.batch.accumulation, b.cfg.eval_iters, b.world.device)
        self.result.eval_losses.append((step, loss))
        b.logger.log({"step": step, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}, kind="eval")

    def after_step(self, step, record):
        if self.built.cfg.eval_interval and step % self.built.cfg.eval_interval == 0:
            self.evaluate(step)

    def at_end(self, step, completed):
        if completed and self.evaluated_at != step:
            self.evaluate(step)


class SaveHook(Hook):
    """--save: a checkpoint every --save-interval steps and at the end (once per step at most). With
    --async-save the step only snapshots it (mtds.checkpoint.async_save): each step boundary first asks whether
    the save in flight is written everywhere (and commits it), and the run's end waits for the last one."""

    def __init__(self, built: BuiltRun):
        self.built = built
        self.saved_at = None
        self.background = None
        if built.cfg.async_save:
            from mtds.checkpoint.async_save import AsyncSaver
            self.background = AsyncSaver(built.engine, built.cfg.save, built.world.groups, built.world.device,
                                         model_cfg=built.world.model_cfg, tokenizer=built.cfg.tokenizer,
                                         rng_tracker=built.world.rng, keep_last=built.cfg.keep_last,
                                         log=built.logger.info)

    def save(self, step: int) -> None:
        if self.saved_at == step:
            return
        b = self.built
        extra = {"data": b.stream.state_dict()}
        if self.background is not None:
            self.background.save(step, extra)
        else:
            ckpt.save(b.engine, b.cfg.save, step, extra, b.world.groups, model_cfg=b.world.model_cfg,
                      tokenizer=b.cfg.tokenizer, rng_tracker=b.world.rng, keep_last=b.cfg.keep_last)
        self.saved_at = step

    def after_step(self, step, record):
        if self.background is not None:
            self.background.poll()
        if self.built.cfg.save_interval and step % self.built.cfg.save_interval == 0:
            self.save(step)

    def at_end(self, step, completed):
        if completed:
            self.save(step)
        if self.background is not None:     # the last save (and a signal's) is complete before the run returns
            self.background.finish()


class SignalStopHook(Hook):
    """SIGTERM/SIGINT on any rank: every rank stops after the same step, saving first (--save-on-signal)."""

    def __init__(self, built: BuiltRun, stop: StopRequest, saver: SaveHook | None, agreed: NonFiniteHook):
        self.built, self.stop, self.saver, self.agreed = built, stop, saver, agreed

    def after_step(self, step, record):
        reason = self.stop.name(self.agreed.flags.signal)    # agreed by every rank in NonFiniteHook's collective
        if reason:
            cfg = self.built.cfg
            if self.saver is not None and cfg.save_on_signal:
                self.saver.save(step)
            saved = self.saver is not None and self.saver.saved_at == step
            self.built.logger.info(f"stopped after step {step} on {reason}"
                                   + (f"; checkpoint in {cfg.save}" if saved else ""))
        return reason


def step_hooks(built: BuiltRun, result: RunResult, stop: StopRequest, start_step: int) -> list[Hook]:
    """The run's hooks in the order they see each step. The order is part of the contract: the patch
    check comes first (before anything reports the step's numbers); the tracer reads its counters and
    the timeline its bubble before the record is logged; the non-finite check comes before evaluation
    and saving (its collective also agrees on signals); the signal check is last (it may save this step)."""
    cfg, tracer = built.cfg, built.world.tracer
    hooks: list[Hook] = [ProfileHook(built, result)] if cfg.profile_step else []
    hooks.append(PatchesRanHook(built.engine, start_step + 1))
    if tracer is not None:
        hooks.append(CommTraceHook(tracer, result))
    if cfg.timeline and built.world.layout.pp > 1:
        hooks.append(TimelineHook(built))
    if built.world.model_cfg.num_experts:     # every stage, with or without MoE blocks of its own (a collective)
        groups = built.world.groups
        hooks.append(ExpertLoadHook(ExpertLoad(moe_blocks(built.model), built.world.model_cfg.num_experts,
                                               groups.dp_group, groups.pp_group, built.world.device,
                                               z_loss=built.world.model_cfg.moe_z_loss_coeff > 0)))
        if built.world.model_cfg.moe_router_bias_update_rate:
            # d alone: the blocks' counts are the whole sequence's already (summed over c, mtds.model.moe)
            hooks.append(ExpertBiasHook(moe_blocks(built.model), built.world.model_cfg.moe_router_bias_update_rate,
                                        groups.dp_group))
    if cfg.log_straggler and built.world.size > 1:
        hooks.append(StragglerHook(built, result))
    hooks.append(LogHook(built.logger))
    agreed = NonFiniteHook(built, stop)
    hooks.append(agreed)
    if cfg.check_replicas_interval:
        hooks.append(ReplicaCheckHook(built))
    hooks.append(EvalHook(built, result))
    saver = SaveHook(built) if cfg.save else None
    if saver is not None:
        hooks.append(saver)
    hooks.append(SignalStopHook(built, stop, saver, agreed))
    return hooks
