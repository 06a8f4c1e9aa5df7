"""Instrument a training run (``mtds.training.build`` / ``train_loop``) from the outside, in the current process only.

``LoopProbe.install()`` must run before ``run()`` starts DeepSpeed. It

* installs a ``CommTracer`` *before* ``deepspeed.init_distributed``: DeepSpeed caches
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` when its backend starts, so a tracer installed
  later (as ``run()``'s own is) never sees ZeRO's parameter all-gathers or gradient reduce-scatters;
* names mtds's tp / dp / pp groups in it (wrapping ``ParallelLayout.build_groups``);
* wraps ``build.build_model`` (RSS just before the model exists, parameter count of this rank) and
  ``train_loop.train_step`` (wall time and process CPU time of every step, the collectives of every step,
  and — one pipeline stage only — the time inside the engine's forward / backward / step calls). CPU time
  (all the process's threads, gloo's included) does not count time spent waiting for a core or for a
  peer, so on a shared host it compares the work two programs do when wall times are noise.
"""
from __future__ import annotations

import time

from lab.measure import PhaseTimer, current_rss_gib, maybe_profile


def _is_pipeline(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine
    return isinstance(engine, PipelineEngine)   # one train_batch() call: no separate phases to time


class LoopProbe:
    def __init__(self, warmup: int = 0, profile_step: int | None = None, barrier: bool = False) -> None:
        from mtds.observe.comm_trace import CommTracer
        self.warmup = warmup
        # a barrier before each step, outside its timing: every rank's step then starts at the same moment,
        # so the slowest rank's time is the step's (compare's definition, the peers' too)
        self.barrier = barrier
        self.profile_step = profile_step          # 1-based step to run under torch.profiler
        self.profile: dict = {}
        self.tracer = CommTracer()
        self.timer = PhaseTimer()
        self.step_times: list[float] = []
        self.step_cpu: list[float] = []           # process CPU seconds of each step (time.process_time)
        self.comm_per_step: list[dict] = []
        self.rss_before_model_gib: float | None = None
        self.parameters: int | None = None

    def install(self) -> "LoopProbe":
        from mtds.parallel.layout import ParallelLayout
        from mtds.training import build, train_loop
        self.tracer.install()
        build_groups, build_model, train_step = ParallelLayout.build_groups, build.build_model, train_loop.train_step
        probe = self

        def named_build_groups(layout, *args, **kwargs):
            groups = build_groups(layout, *args, **kwargs)
            for name in ("tp", "dp", "pp"):
                probe.tracer.name_group(getattr(groups, f"{name}_group"), name)
            return groups

        def measured_build_model(*args, **kwargs):
            probe.rss_before_model_gib = current_rss_gib()
            model = build_model(*args, **kwargs)
            probe.parameters = sum(p.numel() for p in model.parameters())
            return model

        def measured_train_step(engine, *args, **kwargs):
            if not getattr(engine, "_probe_timed", False) and not _is_pipeline(engine):
                # Instance attributes shadow the bound methods; Module.__call__ looks up self.forward.
                engine.forward = probe.timer.wrap("forward", engine.forward)
                engine.backward = probe.timer.wrap("backward", engine.backward)
                engine.step = probe.timer.wrap("optimizer", engine.step)
                engine._probe_timed = True
            probe.timer.enabled = len(probe.step_times) >= probe.warmup
            if probe.barrier:
                import torch.distributed as dist
                dist.barrier()
            probe.tracer.reset()
            start, cpu = time.perf_counter(), time.process_time()
            with maybe_profile(len(probe.step_times) + 1 == probe.profile_step, probe.profile):
                loss = train_step(engine, *args, **kwargs)
            elapsed = time.perf_counter() - start
            probe.step_cpu.append(time.process_time() - cpu)
            probe.comm_per_step.append(probe.tracer.summary())
            if probe.timer.enabled:
                probe.timer.totals["total"] += elapsed
            probe.step_times.append(elapsed)
            return loss

        ParallelLayout.build_groups = named_build_groups
        build.build_model, train_loop.train_step = measured_build_model, measured_train_step
        return self

    def phases_per_step(self) -> dict[str, float]:
        """Mean seconds per measured step in each phase; 'data+other' is the rest of the step."""
        measured = max(len(self.step_times) - self.warmup, 1)
        phases = self.timer.per_step(measured)
        total = phases.pop("total", 0.0)
        if phases:
            phases["data+other"] = total - sum(phases.values())
        return phases
