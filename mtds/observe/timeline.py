"""Pipeline timeline: record when each instruction of a step starts and ends on every rank, measure the
bubble, and write a Chrome trace (Perfetto) and a PNG Gantt chart of all ranks.

Usage in an engine (one recorder per process)::

    rec = TimelineRecorder.for_device(rank=stage_id, device=engine.device)   # CUDA events on GPU
    dist.barrier(group)          # optional: align the ranks' step origins
    rec.begin_step()
    with rec.record("F", chunk=0, micro=3): ...
    with rec.record("send", chunk=0, micro=3): ...
    rec.end_step()
    events = gather_events(rec.events, group=pipe_group, dst=global_rank_of_stage_0)   # list on dst
    if events is not None: write_chrome_trace(events, "t.json"); write_gantt_png(events, "t.png")

Times are seconds since ``begin_step`` on each rank's own clock (host monotonic clock on CPU; CUDA events
on GPU, so spans cover kernels rather than their launches), so ranks line up only as well as their step
starts do (a barrier before ``begin_step`` makes them agree to within its latency).

Measured bubble, per rank (``measured_bubble``): ``step_time`` is the rank's ``end_step − begin_step``
wall time; ``compute`` is the time inside compute instructions (kinds F, B, W; overlapping intervals
counted once); ``idle = step_time − compute`` -- waiting on receives, sends, gradient reduction and the
optimizer step all count as idle; ``bubble_fraction = idle / step_time``. (The papers' bubble "fraction"
divides by the ideal compute time instead: ``idle / compute``, also returned, as ``bubble_ratio``.)
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

COMPUTE_KINDS = ("F", "B", "W")
KIND_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "send": "#8172B3", "recv": "#937860",
                "reduce": "#C44E52", "tied": "#CCB974", "step": "#DA8BC3", "other": "#8C8C8C",
                # an MoE block's dispatch all-to-all in flight, and the shared expert computed meanwhile
                "a2a": "#64B5CD", "shared": "#2F4B7C"}
STEP_EVENT = "step"  # name of the whole-step marker event end_step() adds (kind "other")


@dataclass(frozen=True)
class TimelineEvent:
    rank: int
    kind: str            # F, B, W, send, recv, reduce (data parallel), tied (tied weights), step, other
    start: float         # seconds since the rank's step origin (simulation: cost units)
    end: float
    chunk: int | None = None
    micro: int | None = None
    name: str = ""

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return f"{self.kind}{'' if self.micro is None else self.micro}" + \
            ("" if not self.chunk else f".c{self.chunk}")


class EventClock:
    """Marks are CUDA events recorded on the current stream: taking one costs no host sync, and it
    stamps when the GPU reaches that point (kernels, not their launch). ``seconds`` resolves marks once
    the step is over, after waiting for the last one. Never synchronising mid-step matters under NCCL:
    a host that waits for a send kernel its peer has not yet matched would hang the pipeline."""

    def __init__(self, device):
        import torch
        self.torch, self.device = torch, device

    def mark(self):
        event = self.torch.cuda.Event(enable_timing=True)
        event.record(self.torch.cuda.current_stream(self.device))
        return event

    def seconds(self, origin, marks: list) -> list[float]:
        if marks:
            marks[-1].synchronize()
        return [origin.elapsed_time(m) / 1000.0 for m in marks]


class HostClock:
    """Marks are host clock readings (``sync`` first, if given)."""

    def __init__(self, clock=time.perf_counter, sync=None):
        self.clock, self.sync = clock, sync

    def mark(self) -> float:
        if self.sync is not None:
            self.sync()
        return self.clock()

    def seconds(self, origin: float, marks: list) -> list[float]:
        return [m - origin for m in marks]


class TimelineRecorder:
    """Records one rank's events of the current step (``begin_step`` clears them; their times are
    resolved by ``end_step``, so read ``events`` after it).

    On CPU the marks are host clock readings; on CUDA (``for_device``) CUDA events on the compute
    stream, resolved at the end of the step (see :class:`EventClock`)."""

    def __init__(self, rank: int, clock=time.perf_counter, sync=None, marks=None):
        self.rank = rank
        self.marks = marks if marks is not None else HostClock(clock, sync)
        self.events: list[TimelineEvent] = []
        self._pending: list[tuple] = []
        self._origin = None

    @classmethod
    def for_device(cls, rank: int, device) -> "TimelineRecorder":
        import torch
        device = torch.device(device)
        return cls(rank, marks=EventClock(device) if device.type == "cuda" else None)

    def begin_step(self) -> None:
        self.events, self._pending = [], []
        self._origin = self.marks.mark()

    def _mark(self):
        if self._origin is None:
            raise RuntimeError("TimelineRecorder: call begin_step() before recording")
        return self.marks.mark()

    @contextmanager
    def record(self, kind: str, chunk: int | None = None, micro: int | None = None, name: str = ""):
        start = self._mark()
        try:
            yield
        finally:
            self._pending.append((kind, start, self._mark(), chunk, micro, name))

    def add(self, kind: str, start: float, end: float, chunk=None, micro=None, name: str = "") -> None:
        """An event with times already in seconds since the step origin."""
        self.events.append(TimelineEvent(self.rank, kind, start, end, chunk, micro, name))

    def end_step(self) -> float:
        """Close the step: resolve the marks, add the whole-step marker event; returns the step time."""
        end = self._mark()
        marks = [m for (_, start, stop, *_) in self._pending for m in (start, stop)] + [end]
        seconds = self.marks.seconds(self._origin, marks)
        for i, (kind, _, _, chunk, micro, name) in enumerate(self._pending):
            self.add(kind, seconds[2 * i], seconds[2 * i + 1], chunk=chunk, micro=micro, name=name)
        self._pending = []
        self.add("other", 0.0, seconds[-1], name=STEP_EVENT)
        return seconds[-1]


def step_times(events: list[TimelineEvent]) -> dict[int, float]:
    """Per-rank step wall time: the end of its ``end_step`` marker, else of its last event."""
    last: dict[int, float] = {}
    marked: dict[int, float] = {}
    for e in events:
        last[e.rank] = max(last.get(e.rank, 0.0), e.end)
        if e.kind == "other" and e.name == STEP_EVENT:
            marked[e.rank] = e.end
    return {rank: marked.get(rank, end) for rank, end in last.items()}


def compute_time(events: list[TimelineEvent], rank: int) -> float:
    """Time rank ``rank`` spends inside F/B/W, overlapping intervals merged."""
    spans = sorted((e.start, e.end) for e in events if e.rank == rank and e.kind in COMPUTE_KINDS)
    total, cur_start, cur_end = 0.0, None, None
    for s, t in spans:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, t
        else:
            cur_end = max(cur_end, t)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def measured_bubble(events: list[TimelineEvent], step_time: float | dict | None = None) -> dict[int, dict]:
    """Per rank: step_time, compute, idle, bubble_fraction (idle/step_time), bubble_ratio (idle/compute).

    ``step_time``: one number for every rank (e.g. the simulation's makespan), a per-rank dict, or None
    for each rank's own (``step_times``)."""
    own = step_times(events)
    out = {}
    for rank in sorted(own):
        total = step_time.get(rank, own[rank]) if isinstance(step_time, dict) else (step_time or own[rank])
        busy = compute_time(events, rank)
        idle = total - busy
        out[rank] = {"step_time": total, "compute": busy, "idle": idle,
                     "bubble_fraction": idle / total if total else 0.0,
                     "bubble_ratio": idle / busy if busy else float("inf")}
    return out


def events_from_simulation(result) -> list[TimelineEvent]:
    """A ``lab.pipe_sim.simulate.SimResult`` as timeline events (times in cost units), with step markers at
    the makespan, so the same writers draw theory Gantts."""
    events = [TimelineEvent(e.rank, e.kind, e.start, e.end, e.chunk, e.micro) for e in result.events]
    events += [TimelineEvent(r, "other", 0, result.step_time, name=STEP_EVENT) for r in range(result.p)]
    return events


def chrome_trace(events: list[TimelineEvent], time_unit_us: float = 1e6) -> dict:
    """Chrome trace-event JSON object: one process per rank, compute on thread 0, everything else on
    thread 1, complete ("X") events; ``time_unit_us`` microseconds per event time unit."""
    trace = []
    for rank in sorted({e.rank for e in events}):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "compute"}})
        trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "comm / step"}})
    for e in events:
        args = {k: v for k, v in (("chunk", e.chunk), ("micro", e.micro)) if v is not None}
        trace.append({"name": e.label, "cat": e.kind, "ph": "X", "pid": e.rank,
                      "tid": 0 if e.kind in COMPUTE_KINDS else 1,
                      "ts": e.start * time_unit_us, "dur": (e.end - e.start) * time_unit_us, "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: list[TimelineEvent], path: str, time_unit_us: float = 1e6) -> str:
    _makedirs(path)
    with open(path, "w") as f:
        json.dump(chrome_trace(events, time_unit_us), f)
    return path


def write_gantt_png(events: list[TimelineEvent], path: str, title: str = "", time_label: str = "seconds",
                    step_time: float | dict | None = None) -> str:
    """All ranks of one step as a Gantt chart (:func:`gantt_figure`), saved as a PNG."""
    import matplotlib.pyplot as plt
    fig = gantt_figure(events, title, time_label, step_time)
    _makedirs(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# What the label on a compute bar means: the micro-batch, then the model chunk after a prime (chunk 0 unmarked)
BAR_LABELS = {False: "n: micro-batch n", True: "n'c: micro-batch n of model chunk c (n alone: chunk 0)"}


def gantt_figure(events: list[TimelineEvent], title: str = "", time_label: str = "seconds",
                 step_time: float | dict | None = None):
    """All ranks of one step as a Gantt chart: compute bars full height, comm/reduce/step thin below;
    each rank's measured bubble fraction on its row label; a legend of the kinds and of the bars' labels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({e.rank for e in events})
    labelled = chunks = False
    bubbles = measured_bubble(events, step_time)
    span = max((e.end for e in events), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(min(24, 6 + 0.25 * len(events) / max(1, len(ranks))), 1 + 0.7 * len(ranks)))
    for e in sorted(events, key=lambda e: e.start - e.end):    # longest first: a span inside another stays visible
        if e.name == STEP_EVENT:
            continue
        y = len(ranks) - 1 - ranks.index(e.rank)
        compute = e.kind in COMPUTE_KINDS
        bottom, height = (y - 0.4, 0.6) if compute else (y + 0.25, 0.15)
        ax.broken_barh([(e.start, max(e.end - e.start, span * 1e-4))], (bottom, height),
                       facecolors=KIND_COLOURS.get(e.kind, KIND_COLOURS["other"]), edgecolor="white",
                       linewidth=0.5)
        if compute and e.micro is not None and (e.end - e.start) > span / 60:
            labelled, chunks = True, chunks or bool(e.chunk)
            ax.text((e.start + e.end) / 2, y - 0.1, str(e.micro) + ("" if not e.chunk else f"'{e.chunk}"),
                    ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}\nbubble {bubbles[r]['bubble_fraction']:.1%}" for r in reversed(ranks)])
    ax.set_xlim(0, span)
    ax.set_xlabel(time_label)
    kinds = [k for k in KIND_COLOURS if any(e.kind == k and e.name != STEP_EVENT for e in events)]
    handles = [Patch(color=KIND_COLOURS[k], label=k) for k in kinds]
    if labelled:
        handles.append(Patch(color="none", label=BAR_LABELS[chunks]))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def gather_events(events: list[TimelineEvent], group=None, dst: int = 0) -> list[TimelineEvent] | None:
    """Collect every rank's events on global rank ``dst`` (``dist.gather_object`` over ``group``); the
    merged list there, None elsewhere. Collective: every rank of ``group`` must call it."""
    import torch.distributed as dist
    world = dist.get_world_size(group)
    gathered = [None] * world if dist.get_rank() == dst else None
    dist.gather_object([asdict(e) for e in events], gathered, dst=dst, group=group)
    if gathered is None:
        return None
    return [TimelineEvent(**d) for part in gathered for d in part]


def _makedirs(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
