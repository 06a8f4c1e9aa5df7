"""Simulate DeepSpeed's own ``DualPipeVSchedule`` instruction stream (mtds runs it; it is not
reimplemented here) to know its bubble: the planner's DualPipeV term comes from this, not from a guess.

DeepSpeed 0.19.8's DualPipeV engine queues sends and receives and launches each queue as one
``batch_isend_irecv`` at ``CommitP2P``, then waits for it. Modelled as: a queued send becomes available
to its receiver at the sender's next commit; a commit blocks until every receive queued before it has
arrived (with ``rendezvous=True`` also until its sends' receivers have entered their matching commit);
a compute instruction must use only what earlier commits received. Both models give the same idle time. B is the full backward
(0.19.8 keeps W inside its BackwardPass) and forward and backward of a pair run one after the other.
Placement: chunk (phase) 0 of rank r is stage r, chunk 1 is stage 2p − 1 − r (``v_shape_stage``).
"""
from __future__ import annotations

from mtds.pipe.schedules import Action
from lab.pipe_sim.simulate import ScheduleDeadlock, SimEvent, SimResult, v_shape_stage


def deepspeed_dualpipev_steps(p: int, m: int, rank: int) -> list:
    """DeepSpeed's instructions for one rank, flattened, as (op, chunk, micro) with op in
    F, B (compute), SF/SB (send activation / grad), RF/RB (receive activation / grad), C (commit)."""
    from deepspeed.runtime.pipe import schedule as ds
    names = {ds.ForwardPass: "F", ds.BackwardPass: "B", ds.SendActivation: "SF", ds.SendGrad: "SB",
             ds.RecvActivation: "RF", ds.RecvGrad: "RB"}
    out = []
    for step in ds.DualPipeVSchedule(micro_batches=m, stages=p, stage_id=rank).steps():
        for cmd in step:
            if isinstance(cmd, ds.CommitP2P):
                out.append(("C", None, None))
            elif type(cmd) in names:
                phase = cmd.kwargs.get("phase", 0)
                out.append((names[type(cmd)], phase, cmd.buffer_id - phase * m))
    return out


def deepspeed_dualpipev_actions(p: int, m: int, rank: int) -> list[Action]:
    """The compute order alone (chunk = phase; B = full backward), for ``simulate.validate`` and
    ``simulate.peak_in_flight``."""
    return [Action(op, chunk, micro) for op, chunk, micro in deepspeed_dualpipev_steps(p, m, rank)
            if op in ("F", "B")]


def simulate_deepspeed_dualpipev(p: int, m: int, costs: dict | None = None, rendezvous: bool = False) -> SimResult:
    """Unit costs by default: per chunk F = 1, full B = 2 (the convention of ``simulate``).
    ``rendezvous``: a commit also waits until the receivers of its sends have entered their matching
    commit (a send completes only against a posted receive, as with NCCL and gloo's TCP pairs)."""
    costs = costs or {"F": 1, "B": 2}
    streams = [deepspeed_dualpipev_steps(p, m, r) for r in range(p)]
    send_entry, recv_entry = {}, {}   # message key (kind, producing stage, micro) -> commit entry time
    local = [set() for _ in range(p)]   # (kind, stage, micro) computed on each rank
    clock, busy, pos = [0] * p, [0] * p, [0] * p
    queued_sends = [[] for _ in range(p)]
    queued_recvs = [[] for _ in range(p)]
    received = [set() for _ in range(p)]
    events = []

    def message(op, rank, chunk, micro):
        stage = v_shape_stage(p, rank, chunk)
        return {"SF": ("F", stage, micro), "SB": ("B", stage, micro),
                "RF": ("F", stage - 1, micro), "RB": ("B", stage + 1, micro)}[op]

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(streams[r]):
                op, chunk, micro = streams[r][pos[r]]
                if op in ("SF", "SB"):
                    queued_sends[r].append(message(op, r, chunk, micro))
                elif op in ("RF", "RB"):
                    queued_recvs[r].append(message(op, r, chunk, micro))
                elif op == "C":
                    for key in queued_sends[r]:
                        send_entry.setdefault(key, clock[r])
                    for key in queued_recvs[r]:
                        recv_entry.setdefault(key, clock[r])
                    partners = [send_entry.get(k) for k in queued_recvs[r]]
                    if rendezvous:
                        partners += [recv_entry.get(k) for k in queued_sends[r]]
                    if any(t is None for t in partners):
                        break  # blocked in the commit's wait
                    clock[r] = max([clock[r]] + partners)
                    received[r].update(queued_recvs[r])
                    queued_sends[r], queued_recvs[r] = [], []
                else:
                    stage = v_shape_stage(p, r, chunk)
                    need = _input_of(op, stage, micro, 2 * p)
                    if need is not None and need not in received[r] and need not in local[r]:
                        raise ScheduleDeadlock(f"rank {r}: {op} of stage {stage} micro {micro} runs before "
                                               f"its input {need} was received")
                    start, end = clock[r], clock[r] + costs[op]
                    local[r].add((op, stage, micro))
                    events.append(SimEvent(r, op, chunk, micro, start, end))
                    clock[r], busy[r] = end, busy[r] + costs[op]
                pos[r] += 1
                progress = True
    stuck = [r for r in range(p) if pos[r] < len(streams[r])]
    if stuck:
        raise ScheduleDeadlock("deadlock: ranks " + ", ".join(map(str, stuck)) + " wait in CommitP2P")
    return SimResult(p=p, step_time=max(clock), busy=busy, events=events)


def _input_of(op: str, stage: int, micro: int, n_stages: int):
    if op == "F":
        return ("F", stage - 1, micro) if stage > 0 else None
    return ("B", stage + 1, micro) if stage < n_stages - 1 else None
