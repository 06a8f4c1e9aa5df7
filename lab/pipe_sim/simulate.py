"""Discrete-event simulation of per-rank action lists (``mtds.pipe.schedules``) on p ranks.

Model (the engine's semantics, see ``schedules``' docstring): each rank executes its actions in order,
one at a time; sends are asynchronous (never delay the sender); a forward of a non-first virtual stage
starts only once the previous virtual stage's forward of that micro-batch has finished (plus ``comm``
latency), a backward of a non-last virtual stage only once the next virtual stage's backward has
finished. A rank that waits for a message never sent is a deadlock (``ScheduleDeadlock``). These are
gloo's semantics (buffered sends); ``lab.pipe_sim.nccl_sim`` runs the engine's p2p program under NCCL's.

Cost convention: by default every action costs one unit, F = B = W = 1, for schedules with W passes;
for schedules without (B is the full backward, input + weight gradient) B = 2, so F + B(+W) = 3 units
per micro-batch per chunk in both cases and step times are comparable.

Bubble, two ways of saying the same thing (per rank, all ranks start at 0 and the step ends when the
last rank finishes): ``idle = step_time − busy``;
``bubble_ratio = idle / busy`` -- the papers' "bubble fraction" (PTD-P: (p−1)/m for 1F1B, (p−1)/(v·m)
interleaved; ZB-H1 (p−1)/(3m) with equal F/B/W), i.e. bubble time over ideal compute time; and
``idle_fraction = idle / step_time`` -- what a timeline measures, = bubble_ratio / (1 + bubble_ratio).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from mtds.pipe.schedules import Action, has_weight_pass, schedule_actions


class ScheduleDeadlock(RuntimeError):
    """Some rank waits for a message that is never sent."""


class InvalidSchedule(ValueError):
    """The action lists do not run every (chunk, micro-batch) exactly once in a valid local order."""


@dataclass(frozen=True)
class SimEvent:
    rank: int
    kind: str
    chunk: int
    micro: int
    start: float
    end: float


@dataclass
class SimResult:
    p: int
    step_time: float
    busy: list = field(default_factory=list)      # per rank
    events: list = field(default_factory=list)    # SimEvent, in execution order per rank

    @property
    def idle(self) -> list:
        return [self.step_time - b for b in self.busy]

    @property
    def bubble_ratio(self) -> list:
        return [_ratio(i, b) for i, b in zip(self.idle, self.busy)]

    @property
    def idle_fraction(self) -> list:
        return [_ratio(i, self.step_time) for i in self.idle]


def _ratio(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return Fraction(a, b)
    return a / b


def default_costs(name: str) -> dict:
    return {"F": 1, "B": 1, "W": 1} if has_weight_pass(name) else {"F": 1, "B": 2, "W": 0}


def simulate_schedule(name: str, p: int, v: int, m: int, costs: dict | None = None, comm=0) -> SimResult:
    """Simulate ``name`` at (p, v, m); unit costs by default (see module docstring)."""
    actions = [schedule_actions(name, p, v, m, r) for r in range(p)]
    return simulate(actions, p=p, v=v, m=m, costs=costs or default_costs(name),
                    weight_pass=has_weight_pass(name), comm=comm)


def validate(actions: list, *, p: int, v: int, m: int, weight_pass: bool) -> None:
    """Every (chunk, micro) on every rank: F once, then B once, then W once (iff ``weight_pass``)."""
    kinds = ("F", "B", "W") if weight_pass else ("F", "B")
    for rank, acts in enumerate(actions):
        done = set()
        for a in acts:
            if a.kind not in kinds or not (0 <= a.chunk < v and 0 <= a.micro < m):
                raise InvalidSchedule(f"rank {rank}: action {a} is not valid at v={v}, m={m}")
            if (a.kind, a.chunk, a.micro) in done:
                raise InvalidSchedule(f"rank {rank}: {a} runs twice")
            before = kinds[kinds.index(a.kind) - 1] if a.kind != "F" else None
            if before and (before, a.chunk, a.micro) not in done:
                raise InvalidSchedule(f"rank {rank}: {a} runs before its {before}")
            done.add((a.kind, a.chunk, a.micro))
        if len(done) != len(kinds) * v * m:
            raise InvalidSchedule(f"rank {rank}: runs {len(done)} actions, expected {len(kinds) * v * m}")


def interleaved_stage(p: int, rank: int, chunk: int) -> int:
    """Virtual stage of (rank, chunk) in Megatron's interleaved placement (v = 1: the rank)."""
    return chunk * p + rank


def v_shape_stage(p: int, rank: int, chunk: int) -> int:
    """Virtual stage of (rank, chunk) in DualPipeV's V placement: chunk 0 is stage ``rank``, chunk 1 is
    stage ``2p − 1 − rank`` (activations go down the ranks and come back up)."""
    return rank if chunk == 0 else 2 * p - 1 - rank


def simulate(actions: list, *, p: int, v: int, m: int, costs: dict, weight_pass: bool, comm=0,
             stage_of=interleaved_stage) -> SimResult:
    """Run per-rank action lists; raise ``InvalidSchedule`` or ``ScheduleDeadlock``.
    ``stage_of(p, rank, chunk)`` places chunks on virtual stages (default: interleaved)."""
    validate(actions, p=p, v=v, m=m, weight_pass=weight_pass)
    n_virtual = p * v
    finished = {}                      # (kind, virtual stage, micro) -> end time
    clock = [0] * p
    busy = [0] * p
    pos = [0] * p
    events = []
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while pos[rank] < len(actions[rank]):
                a: Action = actions[rank][pos[rank]]
                stage = stage_of(p, rank, a.chunk)
                ready = _message_ready(a, stage, n_virtual, finished, comm)
                if ready is None:
                    break  # blocked on a receive; other ranks may unblock it
                start = max(clock[rank], ready)
                end = start + costs[a.kind]
                finished[(a.kind, stage, a.micro)] = end
                events.append(SimEvent(rank, a.kind, a.chunk, a.micro, start, end))
                clock[rank], busy[rank] = end, busy[rank] + costs[a.kind]
                pos[rank] += 1
                progress = True
    stuck = [r for r in range(p) if pos[r] < len(actions[r])]
    if stuck:
        waits = ", ".join(f"rank {r} at {actions[r][pos[r]]}" for r in stuck)
        raise ScheduleDeadlock(f"deadlock: {waits} wait for messages never sent")
    return SimResult(p=p, step_time=max(clock), busy=busy, events=events)


def _message_ready(a: Action, stage: int, n_virtual: int, finished: dict, comm):
    """Arrival time of the message ``a`` blocks on (0 when none), or None if it is not yet sent."""
    if a.kind == "F":
        need = ("F", stage - 1, a.micro) if stage > 0 else None
    elif a.kind == "B":
        need = ("B", stage + 1, a.micro) if stage < n_virtual - 1 else None
    else:
        need = None  # W is local; its B ran earlier on this rank (validated)
    if need is None:
        return 0
    if need not in finished:
        return None
    return finished[need] + comm


def peak_in_flight(actions: list, weight_pass: bool) -> int:
    """Most (chunk, micro-batch) activations a rank holds at once: counted from F until the pass that
    frees them (W when the schedule has W passes -- W still needs the layer inputs -- else B)."""
    release = "W" if weight_pass else "B"
    held = peak = 0
    for a in actions:
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif a.kind == release:
            held -= 1
    return peak
