"""``--timeline``: record every pipeline instruction of each step on every rank, measure the bubble, and
write the last step as a Chrome trace (Perfetto) and a PNG Gantt chart of all pipeline ranks.

mtds's own engine records its instructions itself (``ScheduledPipelineEngine.timeline``). On DeepSpeed's
engines (``PipelineEngine`` for 1f1b, ``DualPipeVEngine``) every instruction handler is wrapped in a
recorder span (``mtds.deepspeed_compat.pipeline.wrap_instruction_handlers``). Micro-batch numbers of
those engines are counted: each stage (chunk/phase) runs its forwards, and its backwards, in
micro-batch order.
"""
from __future__ import annotations

import os
from collections import defaultdict
from functools import wraps

import torch.distributed as dist

from mtds.deepspeed_compat.pipeline import wrap_instruction_handlers
from mtds.deepspeed_compat.zero1_reduce import attach_timeline

from mtds.observe.timeline import TimelineRecorder, gather_events, measured_bubble, write_chrome_trace, write_gantt_png

# DeepSpeed instruction class name -> timeline kind
_KINDS = {"ForwardPass": "F", "BackwardPass": "B", "SendActivation": "send", "SendGrad": "send",
          "RecvActivation": "recv", "RecvGrad": "recv", "CommitP2P": "recv", "ReduceGrads": "reduce",
          "ReduceTiedGrads": "tied", "OptimizerStep": "step", "LoadMicroBatch": "other"}


def _instrument_deepspeed(engine, recorder: TimelineRecorder, counters: defaultdict) -> None:
    """``counters``: (kind, chunk) -> micro-batches seen this step."""

    def wrap(instruction, handler):
        kind = _KINDS.get(instruction.__name__, "other")

        @wraps(handler)
        def run(self, **kwargs):
            chunk = kwargs.get("phase", 0)
            micro = None
            if kind in ("F", "B"):
                micro = counters[kind, chunk]
                counters[kind, chunk] += 1
                if not self.module.training:
                    micro = None
            name = "" if kind in ("F", "B") else instruction.__name__
            with recorder.record(kind, chunk=chunk if kind in ("F", "B") else None, micro=micro, name=name):
                return handler(self, **kwargs)
        return run

    wrap_instruction_handlers(engine, wrap)


class StepTimeline:
    """One per rank. ``begin()`` before a training step, ``end()`` after it: the bubble fields for the
    step's log record (on the reporting rank; {} elsewhere). ``write()`` the last step's files."""

    def __init__(self, engine, groups, path: str):
        self.engine, self.groups, self.path = engine, groups, path
        self.recorder = TimelineRecorder.for_device(rank=groups.pp_rank, device=engine.device)
        self.counters = None
        if hasattr(engine, "timeline"):
            engine.timeline = self.recorder
        else:
            attach_timeline(engine, self.recorder)     # ZeRO-1's early reduction, inside ReduceTiedGrads
            self.counters = defaultdict(int)
            _instrument_deepspeed(engine, self.recorder, self.counters)
        for module in engine.module.modules():   # MoE blocks that overlap their dispatch: its span and the shared's
            if getattr(module, "overlap_dispatch", False):
                module.comm_timeline = self.recorder
        layout = groups.layout
        # gather on the reporting rank's pipeline: the last stage of this TP/DP coordinate
        self.dst = layout.rank_of(groups.tp_rank, groups.dp_rank, layout.pp - 1)
        self.events = None

    def begin(self) -> None:
        dist.barrier(group=self.groups.pp_group)   # align the ranks' step origins
        if self.counters is not None:
            self.counters.clear()
        self.recorder.begin_step()

    def end(self) -> dict:
        self.recorder.end_step()
        events = gather_events(self.recorder.events, group=self.groups.pp_group, dst=self.dst)
        if events is None:
            return {}
        self.events = events
        bubbles = measured_bubble(events)
        per_stage = [round(bubbles[r]["bubble_fraction"], 4) for r in sorted(bubbles)]
        return {"bubble": max(per_stage), "bubble_per_stage": per_stage}

    def write(self, title: str = "") -> list[str]:
        """Chrome trace JSON at ``path`` and a Gantt PNG next to it (``.png``); on the gathering rank of the
        first pipeline (TP and DP rank 0: every pipeline gathers its own, one file is written)."""
        if self.events is None or self.groups.dp_rank != 0 or self.groups.tp_rank != 0:
            return []
        root, _ = os.path.splitext(self.path)
        return [write_chrome_trace(self.events, self.path), write_gantt_png(self.events, root + ".png", title=title)]
