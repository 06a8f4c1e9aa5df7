"""Per-rank compute order of the pipeline schedules mtds runs on its own engine: pure, no processes.

``schedule_actions(name, p, v, m, rank)`` is the list of compute actions one pipeline rank executes in
one training step (one optimizer step, m micro-batches). The engine walks it in order; the simulator
(``lab.pipe_sim.simulate``) walks the same lists, so what the tests prove about an order is what runs.

Placement. Rank ``r`` holds ``v`` model chunks; chunk ``c`` is *virtual stage* ``c·p + r`` of the
``p·v`` virtual stages (Megatron's interleaved placement; ``v = 1`` is plain pipelining, stage = rank).

Communication semantics (what the engine implements and the simulator models):

- After ``F`` of a virtual stage that is not the last, its output activation is **sent asynchronously**
  to the next virtual stage: rank ``r + 1`` same chunk, or, from the last rank, rank 0 chunk ``c + 1``.
  A send never blocks the sender (queued ``isend``, completed later).
- Before ``F`` of a virtual stage that is not the first, the rank **blocks on the receive** of that
  activation.
- Backward mirrors this: after ``B`` of a virtual stage that is not the first, the input gradient is sent
  asynchronously to the previous virtual stage; before ``B`` of a virtual stage that is not the last, the
  rank blocks on the receive of the output gradient. ``B`` of the last virtual stage starts from the loss.
- ``W`` (weight gradients, zb-h1 only) is local: it needs its own ``B`` done, nothing else.

With asynchronous sends, an order deadlocks only if a rank waits for a message whose sender is itself
(transitively) waiting; the simulator checks that no schedule here can. That is gloo's model (buffered
sends). Under NCCL a send waits for its receive and a stream runs its transfers in order; the engine's
p2p program (``mtds.pipe.exchange``) is built so that whatever finishes here finishes there too
(``lab.pipe_sim.nccl_sim``, docs/pipeline.md "p2p under NCCL").

Schedules (``SCHEDULES``):

- ``1f1b`` (v = 1): DeepSpeed/Megatron non-interleaved 1F1B. Rank r runs ``min(p − r − 1, m)`` warm-up
  forwards, then alternates F and B, then the cool-down backwards. ``B`` is the full backward.
- ``interleaved`` (v ≥ 2): Megatron's interleaved 1F1B. Micro-batches go in groups of ``G``; the k-th
  forward walks a group across chunks ``0..v−1``, the k-th backward across chunks ``v−1..0``. Warm-up
  is ``(p − r − 1)·2 + (v − 1)·G`` forwards, capped at ``m·v``. ``B`` is the full backward.
  Supported micro-batch counts: ``m ≥ p`` split into ``m // p`` equal groups, ``G = m / (m // p)``, i.e.
  ``m % (m // p) == 0`` -- every multiple of p (then G = p, Megatron's classic schedule) and e.g. p < m
  < 2p or m = 10 at p = 4 (the group rule of torch.distributed.pipelining's ScheduleInterleaved1F1B).
  The simulator shows these reach the (p − 1)/(v·m) bubble exactly; m < p runs but idles more, and a
  remainder group (m = 3p + 1) is refused: ``check_microbatches`` names the next supported m.
- ``zb-h1`` (v = 1): ZB-H1 of Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", §2.1). 1F1B with B
  (input gradient) split from W (weight gradient); rank r defers its W passes by ``r`` steady-state
  iterations, so every rank holds at most ``p`` micro-batches whose W is pending -- rank 0's 1F1B peak,
  hence the same peak activation memory -- and the ``p − 1`` pending W passes per rank fill the
  cool-down bubble. With equal F/B/W costs the bubble is ``(p − 1)(T_F + T_B − T_W)`` per rank, i.e.
  ``(p − 1)/(3m)`` of the ideal step time ``m(T_F + T_B + T_W)`` (the paper's bubble rate).

DualPipeV is not here: DeepSpeed's own ``DualPipeVSchedule`` runs it.
"""
from __future__ import annotations

from dataclasses import dataclass

from mtds.rules.schedule import chunks_problem, micro_batches_problem

SCHEDULES = ("1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class Action:
    """One compute instruction of a rank.

    ``kind``: ``"F"`` forward; ``"B"`` backward (input gradient only when the schedule has W actions,
    else the full backward); ``"W"`` weight gradient. ``chunk``: the model chunk on this rank, 0..v−1
    (virtual stage ``chunk·p + rank``). ``micro``: the micro-batch, 0..m−1.
    """
    kind: str
    chunk: int
    micro: int


def has_weight_pass(name: str) -> bool:
    """Whether the schedule splits backward into B (input grad) and W (weight grad)."""
    return name == "zb-h1"


def check_microbatches(name: str, p: int, v: int, m: int, samples_per_micro_batch: int | None = None) -> None:
    """Raise ``ValueError`` (one line, with the fix) if ``name`` cannot run ``m`` micro-batches at (p, v): the
    rulebook's rules (mtds.rules.schedule), asked of an order about to be built."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if p < 1 or v < 1 or m < 1:
        raise ValueError(f"pipeline size, virtual stages and micro-batches must be >= 1 (got p={p}, v={v}, m={m})")
    problem = chunks_problem(name, p, v)
    if problem is None and name == "interleaved":
        problem = micro_batches_problem(name, p, m, samples_per_micro_batch)
    if problem is not None:
        raise ValueError(problem)


def interleaved_group_size(p: int, m: int) -> int:
    """G: micro-batches per group that walks the chunks (p when p divides m)."""
    return m // (m // p)


def schedule_actions(name: str, p: int, v: int, m: int, rank: int) -> list[Action]:
    """The ordered compute actions of pipeline rank ``rank`` for one step of ``m`` micro-batches."""
    check_microbatches(name, p, v, m)
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} outside the pipeline of size {p}")
    if name == "1f1b":
        return _one_f_one_b(p, m, rank)
    if name == "interleaved":
        return _interleaved(p, v, m, rank)
    return _zb_h1(p, m, rank)


def forward_actions(name: str, p: int, v: int, m: int, rank: int) -> list[Action]:
    """Forward-only order (evaluation): the training schedule's forwards (the same (chunk, micro) sequence
    on every rank), or chunk by chunk per micro-batch where the schedule cannot take ``m``."""
    try:
        actions = schedule_actions(name, p, v, m, rank)
    except ValueError:
        return [Action("F", c, i) for i in range(m) for c in range(v)]
    return [a for a in actions if a.kind == "F"]


def _one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    warmup = min(p - rank - 1, m)
    actions = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", 0, warmup + i), Action("B", 0, i)]
    actions += [Action("B", 0, i) for i in range(m - warmup, m)]
    return actions


def _interleaved_slot(k: int, g: int, v: int, forward: bool) -> tuple[int, int]:
    """(chunk, micro) of the k-th forward (or backward) on a rank: groups of g micro-batches per chunk."""
    group, within = divmod(k, g * v)
    chunk = within // g
    micro = group * g + within % g
    return (chunk if forward else v - 1 - chunk), micro


def _interleaved(p: int, v: int, m: int, rank: int) -> list[Action]:
    g = interleaved_group_size(p, m)
    total = m * v
    warmup = min((p - rank - 1) * 2 + (v - 1) * g, total)

    def fwd(k):
        return Action("F", *_interleaved_slot(k, g, v, True))

    def bwd(k):
        return Action("B", *_interleaved_slot(k, g, v, False))

    actions = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [fwd(warmup + k), bwd(k)]
    actions += [bwd(k) for k in range(total - warmup, total)]
    return actions


def _zb_h1(p: int, m: int, rank: int) -> list[Action]:
    warmup = min(p - rank - 1, m)
    pending_w: list[int] = []  # micro-batches whose B ran and whose W waits (FIFO)
    actions = [Action("F", 0, i) for i in range(warmup)]

    def backward(i):
        actions.append(Action("B", 0, i))
        pending_w.append(i)

    for i in range(m - warmup):
        actions.append(Action("F", 0, warmup + i))
        backward(i)
        if len(pending_w) > rank:  # rank r keeps r W passes deferred through the steady state
            actions.append(Action("W", 0, pending_w.pop(0)))
    for i in range(m - warmup, m):  # cool-down: each B is followed by one deferred W
        backward(i)
        actions.append(Action("W", 0, pending_w.pop(0)))
    actions += [Action("W", 0, i) for i in pending_w]
    return actions
