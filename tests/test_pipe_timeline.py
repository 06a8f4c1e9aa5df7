"""Timeline recorder and writers, without processes: Chrome trace content, PNG output, bubble arithmetic,
and the simulator's events through the same writers."""
import json
from fractions import Fraction

import pytest

from lab.pipe_sim.simulate import simulate_schedule
from mtds.observe.timeline import (STEP_EVENT, TimelineEvent, TimelineRecorder, chrome_trace, compute_time,
                                events_from_simulation, measured_bubble, write_chrome_trace, write_gantt_png)

# two ranks, step of 10 s: rank 0 computes 2+3 s (the B overlapping a 1 s send), rank 1 computes 4 s
EVENTS = [TimelineEvent(0, "F", 0.0, 2.0, chunk=0, micro=0), TimelineEvent(0, "send", 2.0, 3.0, 0, 0),
          TimelineEvent(0, "B", 5.0, 8.0, 0, 0), TimelineEvent(0, "W", 7.0, 8.0, 0, 0),
          TimelineEvent(0, "step", 9.0, 10.0), TimelineEvent(0, "other", 0.0, 10.0, name=STEP_EVENT),
          TimelineEvent(1, "recv", 0.0, 2.0, 0, 0), TimelineEvent(1, "F", 2.0, 4.0, 1, 0),
          TimelineEvent(1, "B", 4.0, 6.0, 1, 0), TimelineEvent(1, "reduce", 6.0, 7.0),
          TimelineEvent(1, "other", 0.0, 10.0, name=STEP_EVENT)]


def test_bubble_arithmetic():
    assert compute_time(EVENTS, 0) == 5.0  # F 2 + B 3; the W inside B counted once
    bubbles = measured_bubble(EVENTS)
    assert bubbles[0] == {"step_time": 10.0, "compute": 5.0, "idle": 5.0, "bubble_fraction": 0.5,
                          "bubble_ratio": 1.0}
    assert bubbles[1]["idle"] == 6.0 and bubbles[1]["bubble_fraction"] == 0.6
    assert measured_bubble(EVENTS, step_time=20.0)[1]["bubble_fraction"] == pytest.approx(0.8)
    without_marker = [e for e in EVENTS if e.name != STEP_EVENT]  # then the step ends at the last event
    assert measured_bubble(without_marker)[1]["step_time"] == 7.0


def test_chrome_trace_has_one_process_per_rank_and_complete_events(tmp_path):
    path = write_chrome_trace(EVENTS, str(tmp_path / "t" / "trace.json"))
    trace = json.load(open(path))
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(EVENTS)
    b = next(e for e in complete if e["cat"] == "B" and e["pid"] == 0)
    assert (b["ts"], b["dur"], b["tid"], b["args"]) == (5e6, 3e6, 0, {"chunk": 0, "micro": 0})
    f1 = next(e for e in complete if e["cat"] == "F" and e["pid"] == 1)
    assert f1["name"] == "F0.c1"
    assert all(e["tid"] == 1 for e in complete if e["cat"] in ("send", "recv", "reduce", "step"))
    assert chrome_trace(EVENTS, time_unit_us=1000)["traceEvents"][-1]["dur"] == 10_000


def test_gantt_png_written(tmp_path):
    path = write_gantt_png(EVENTS, str(tmp_path / "g.png"), title="synthetic")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_recorder_records_relative_times_and_step_marker():
    ticks = iter([100.0, 101.0, 103.5, 104.0, 106.0])
    rec = TimelineRecorder(rank=3, clock=lambda: next(ticks))
    with pytest.raises(RuntimeError, match="begin_step"):
        with rec.record("F"):
            pass
    rec.begin_step()                       # origin 100
    with rec.record("F", chunk=1, micro=2):  # 101 .. 103.5
        pass
    rec.add("send", 3.5, 3.75, chunk=1, micro=2)
    assert rec.end_step() == 4.0           # 104
    assert TimelineEvent(3, "F", 1.0, 3.5, 1, 2) in rec.events
    assert measured_bubble(rec.events)[3]["bubble_fraction"] == pytest.approx(1.5 / 4.0)
    rec.begin_step()                       # a new step forgets the old events
    assert rec.events == []


def test_recorder_synchronises_before_each_clock_reading():
    calls = []
    rec = TimelineRecorder(rank=0, clock=lambda: float(len(calls)), sync=lambda: calls.append(1))
    rec.begin_step()
    with rec.record("B", 0, 0):
        pass
    rec.end_step()
    assert len(calls) == 4 and rec.events[0].end - rec.events[0].start == 1.0
    assert TimelineRecorder.for_device(0, "cpu").marks.sync is None


class _LazyMarks:
    """Stands in for CUDA events: a mark is a token; times exist only once ``seconds`` resolves them."""

    def __init__(self):
        self.count, self.resolved = 0, 0

    def mark(self):
        self.count += 1
        return self.count

    def seconds(self, origin, marks):
        self.resolved += 1
        return [float(m - origin) for m in marks]


def test_gpu_timeline_marks_without_syncing_and_resolves_once_per_step():
    """On CUDA the recorder records events and waits for the GPU only at the end of the step (a host
    that waited for the device mid-step could hang on an unmatched NCCL send)."""
    from mtds.observe.timeline import EventClock
    assert isinstance(TimelineRecorder.for_device(0, "cuda:0").marks, EventClock)
    marks = _LazyMarks()
    rec = TimelineRecorder(rank=1, marks=marks)
    rec.begin_step()
    for micro in range(3):
        with rec.record("F", 0, micro):
            pass
        assert marks.resolved == 0 and rec.events == []      # nothing waited for, nothing resolved mid-step
    assert rec.end_step() == 7.0 and marks.resolved == 1
    assert [(e.start, e.end) for e in rec.events if e.kind == "F"] == [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)]


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_simulation_renders_through_the_same_writers(tmp_path, name, v):
    p, m = 4, 8
    result = simulate_schedule(name, p, v, m)
    events = events_from_simulation(result)
    measured = measured_bubble(events)
    for rank in range(p):
        assert Fraction(measured[rank]["idle"]) == result.idle[rank]
        assert Fraction(measured[rank]["bubble_fraction"]).limit_denominator(1000) == result.idle_fraction[rank]
    trace = chrome_trace(events, time_unit_us=1000)
    assert sum(e["ph"] == "X" and e["cat"] in "FBW" for e in trace["traceEvents"]) == len(result.events)
    png = write_gantt_png(events, str(tmp_path / f"{name}.png"), time_label="cost units")
    assert open(png, "rb").read(4) == b"\x89PNG"


def test_gather_events_on_a_one_rank_group(tmp_path):
    # the collective path in-process (world of one, gloo): the events come back as TimelineEvents
    import torch.distributed as dist
    from mtds.observe.timeline import gather_events
    created = not dist.is_initialized()   # another in-process test may have left a world of one
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        me = dist.get_rank()
        assert gather_events(EVENTS[:3], group=dist.new_group([me], backend="gloo"), dst=me) == EVENTS[:3]
    finally:
        if created:
            dist.destroy_process_group()


def test_theory_table_and_charts(tmp_path, capsys):
    from benchmarks.schedule_theory import main
    from lab.pipe_sim.theory import theory_bubble
    assert theory_bubble("1f1b", 4, 1, 8) == {"bubble_fraction": 3 / 11, "bubble_ratio": 3 / 8}
    assert theory_bubble("zb-h1", 4, 1, 8)["bubble_ratio"] == 1 / 8
    dual = theory_bubble("dualpipev", 4, 2, 8)     # DeepSpeed's order: 5(p-1) - 1 = 14 idle of 48 busy
    assert dual["bubble_ratio"] == 14 / 48
    main(["--out", str(tmp_path), "--p", "2", "--m", "4"])
    assert "| zb-h1 | 7.7% (0.083) |" in capsys.readouterr().out   # (p-1)/(3m) = 1/12, 1/13 of the step
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "theory_1f1b_p2_m4.png", "theory_dualpipev_p2_m4.png", "theory_interleaved_p2_m4.png", "theory_zb-h1_p2_m4.png"]
