"""NCCL semantics for the p2p programs of ``mtds.pipe.exchange``: does an order finish, and when.

``lab.pipe_sim.simulate`` models gloo, whose sends are buffered: a send never waits. NCCL's do. The model
here is torch's ``ProcessGroupNCCL`` over NCCL, each rule chosen to wait at least as long as the real
thing; every rule is "an event happens once these events have", so a program that finishes here also
finishes when some waits are shorter (the events that can happen only grow as waits are dropped):

- The host issues a rank's program in order and does not wait for transfers or computes (NCCL's
  ``wait`` makes a stream wait, not the host). Computes run one after the other on the compute stream.
- A post (one ``batch_isend_irecv``, or one lone ``isend``/``irecv``) runs as one NCCL kernel on its
  communicator's stream, after the previous post on that stream has completed and after every compute
  issued before it (torch makes the NCCL stream wait for the current stream).
- Communicators (``mode``). ``lazy`` (torch's default): a batch uses its group's communicator, one
  stream for all of the rank's peers on that group; a lone op uses a two-rank communicator of the pair
  within the group, its own stream. Each communicator is created at its first use, the host waiting
  there until every member's host has reached its first use (a batch: every rank of the group). ``eager``
  (a process group made with a ``device_id``): every op of a group on the group's communicator and
  stream, created beforehand.
- Matching: the k-th send from A to B on a communicator meets the k-th receive on B from A on the same
  communicator (NCCL ignores tags); the two must carry the same message (else ``MismatchedTransfer``).
- A transfer completes ``comm`` after both its post and its partner's post have started (a large send
  waits for its receive); a post completes when all its transfers have.
- A compute starts after the previous compute on its rank, after the host issued it, and after the
  post holding the receive it needs completed (the stream waits on the post's work: the whole kernel).

- ``serial`` (``CUDA_DEVICE_MAX_CONNECTIONS=1``, Megatron's usual setting): every stream of a rank is fed
  through one hardware queue, so a kernel starts only after the kernel the host issued before it, on any
  stream, has started (head-of-line: a post waiting for its stream or a compute waiting for its input holds
  back everything issued after it). A started NCCL kernel spins until its partner's starts; kernels
  already started run side by side.

What is not modelled: kernels of different communicators are assumed to progress side by side (NCCL
documents that concurrent communicators "might work provided they fit within the GPU"; mtds's program
has at most four p2p kernels of a rank in flight). An item that never gets a time is a deadlock
(``NcclDeadlock``), reported with what each stuck rank's first unfinished item waits for.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mtds.pipe.exchange import Compute, Post, engine_program, exchange_program
from mtds.pipe.schedules import forward_actions, schedule_actions
from lab.pipe_sim.simulate import ScheduleDeadlock, default_costs

MODES = ("lazy", "eager")


class NcclDeadlock(ScheduleDeadlock):
    """Under NCCL's semantics some rank's program never finishes."""


class MismatchedTransfer(RuntimeError):
    """A send meets a receive that expects another message (NCCL would deliver the wrong tensor)."""


@dataclass
class NcclResult:
    step_time: float
    compute_end: list = field(default_factory=list)   # per rank: when its last compute ended
    send_delay: list = field(default_factory=list)    # per rank: the longest wait of a send post after its compute


def simulate_programs(programs: list, *, costs: dict, comm=0, mode: str = "lazy", serial: bool = False) -> NcclResult:
    """Run per-rank programs (lists of ``Post``/``Compute``); raise ``NcclDeadlock`` or ``MismatchedTransfer``.
    ``serial``: one hardware queue per rank (``CUDA_DEVICE_MAX_CONNECTIONS=1``, see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    s = _Structure(programs, mode)
    # Events: ("arrive", item) the host reaches it; ("host", item) the host issues it (past a communicator's
    # creation); ("start", post); ("done", item). Each happens at the
    # latest time of the events it waits for plus a duration: a worklist over the wait graph.
    waits, duration = {}, {}
    for rank, program in enumerate(programs):
        for i, item in enumerate(program):
            key = (rank, i)
            waits["arrive", key], duration["arrive", key] = ([("host", (rank, i - 1))] if i else []), 0
            waits["host", key] = [("arrive", key)] + [("arrive", k) for k in s.creation.get(key, ())]
            duration["host", key] = 0
            queue = [("start", (rank, i - 1))] if serial and i else []     # the one hardware queue's order
            if isinstance(item, Compute):
                before = [("done", k) for k in (s.prev_compute[key], s.holding.get(key)) if k is not None]
                waits["start", key], duration["start", key] = before + [("host", key)] + queue, 0
                waits["done", key], duration["done", key] = [("start", key)], costs[item.action.kind]
            else:
                before = [("done", k) for k in (s.prev_stream[key], s.prev_compute[key]) if k is not None]
                waits["start", key], duration["start", key] = before + [("host", key)] + queue, 0
                waits["done", key] = [("start", key)] + [("start", s.partner[key, j]) for j in range(len(item.transfers))]
                duration["done", key] = comm
    waiters, missing = {}, {}
    for event, before in waits.items():
        missing[event] = len(before)
        for b in before:
            waiters.setdefault(b, []).append(event)
    time = {}
    ready = [e for e, n in missing.items() if n == 0]
    while ready:
        event = ready.pop()
        time[event] = max((time[b] for b in waits[event]), default=0) + duration[event]
        for w in waiters.get(event, ()):
            missing[w] -= 1
            if missing[w] == 0:
                ready.append(w)
    stuck = [(rank, next(i for i in range(len(prog)) if ("done", (rank, i)) not in time))
             for rank, prog in enumerate(programs) if any(("done", (rank, i)) not in time for i in range(len(prog)))]
    if stuck:
        raise NcclDeadlock("NCCL deadlock: " + "; ".join(s.blocked(r, i, time) for r, i in stuck))
    done = {key: t for (kind, key), t in time.items() if kind == "done"}
    computes = [[done[r, i] for i, it in enumerate(prog) if isinstance(it, Compute)] for r, prog in enumerate(programs)]
    delays = [max([time["start", (r, i)] - (done[s.prev_compute[r, i]] if s.prev_compute[r, i] else 0)
                   for i, it in enumerate(prog) if isinstance(it, Post) and it.transfers[0].op == "send"], default=0)
              for r, prog in enumerate(programs)]
    return NcclResult(step_time=max(done.values(), default=0), compute_end=[c[-1] if c else 0 for c in computes],
                      send_delay=delays)


def simulate_schedule_nccl(name: str, p: int, v: int, m: int, *, policy: str | None = None, costs: dict | None = None,
                           comm=0, mode: str = "lazy", forward_only: bool = False, serial: bool = False) -> NcclResult:
    """The engine's programs for schedule ``name`` at (p, v, m) (``exchange.engine_program``; with
    ``policy``, ``exchange_program`` under that policy) under NCCL's semantics. ``forward_only``: one
    evaluation step (``forward_actions``; any m)."""
    if policy is None:
        programs = [engine_program(name, p, v, m, rank, forward_only=forward_only) for rank in range(p)]
    else:
        order = forward_actions if forward_only else schedule_actions
        programs = [exchange_program(order(name, p, v, m, rank), p=p, v=v, rank=rank, policy=policy) for rank in range(p)]
    return simulate_programs(programs, costs=costs or default_costs(name), comm=comm, mode=mode, serial=serial)


class _Structure:
    """Per item: the previous post on its stream, the previous compute, the post holding a compute's
    receive, the partner post of every transfer, and the first uses a communicator's creation waits for."""

    def __init__(self, programs: list, mode: str):
        self.programs, self.mode = programs, mode
        self.prev_stream, self.prev_compute, self.holding, self.partner, self.creation = {}, {}, {}, {}, {}
        queues, first_use = {}, {}
        for rank, program in enumerate(programs):
            last_on, last_compute, inbox = {}, None, {}
            for i, item in enumerate(program):
                self.prev_compute[rank, i] = last_compute
                if isinstance(item, Compute):
                    last_compute = (rank, i)
                    if item.needs is not None:
                        if item.needs not in inbox:
                            raise ValueError(f"rank {rank}: {item} needs {item.needs}, which no earlier post receives")
                        self.holding[rank, i] = inbox.pop(item.needs)
                    continue
                if len({t.group for t in item.transfers}) != 1 or (not item.batched and len(item.transfers) != 1):
                    raise ValueError(f"rank {rank}: {item}: a batch is on one group, a lone post is one transfer")
                comm_key = self._communicator(rank, item)
                self.prev_stream[rank, i] = last_on.get(comm_key)
                last_on[comm_key] = (rank, i)
                first_use.setdefault(comm_key, {}).setdefault(rank, (rank, i))
                for j, t in enumerate(item.transfers):
                    if t.op == "recv":
                        inbox[t.message] = (rank, i)
                    src, dst = (rank, t.peer) if t.op == "send" else (t.peer, rank)
                    queues.setdefault((comm_key, src, dst, t.op), []).append(((rank, i), j, t))
        self._match(queues)
        if mode == "lazy":
            for comm_key, uses in first_use.items():
                members = comm_key[1] if len(comm_key) > 1 else range(len(programs))
                for rank, key in uses.items():
                    self.creation[key] = [uses[r] for r in members if r != rank and r in uses] + \
                                         [("never", r) for r in members if r not in uses]

    def _communicator(self, rank: int, post: Post) -> tuple:
        if post.batched or self.mode == "eager":
            return (post.group,)
        peer = post.transfers[0].peer
        return post.group, (min(rank, peer), max(rank, peer))

    def _match(self, queues: dict) -> None:
        for (comm_key, src, dst, op), queue in queues.items():
            other = queues.get((comm_key, src, dst, "recv" if op == "send" else "send"), [])
            if len(other) != len(queue):
                raise MismatchedTransfer(f"{len(queue) if op == 'send' else len(other)} sends from rank {src} to rank "
                                         f"{dst} on {comm_key[0]} but {len(other) if op == 'send' else len(queue)} receives")
            if op != "send":
                continue
            for (skey, sj, sent), (rkey, rj, received) in zip(queue, other):
                if sent.message != received.message:
                    raise MismatchedTransfer(f"rank {src} sends {sent.message} where rank {dst} receives "
                                             f"{received.message} on {comm_key[0]}")
                self.partner[skey, sj], self.partner[rkey, rj] = rkey, skey

    def blocked(self, rank: int, i: int, time: dict) -> str:
        """What the first unfinished item ``i`` of ``rank`` waits for."""
        item = self.programs[rank][i]
        head = f"rank {rank} at {item}"
        if ("host", (rank, i)) not in time:
            return f"{head}: its host waits for the other ranks to create the communicator"
        if isinstance(item, Compute):
            held = i and ("start", (rank, i - 1)) not in time
            return f"{head} waits behind {self.programs[rank][i - 1]} in the hardware queue" if held and \
                (item.needs is None or ("done", self.holding[rank, i]) in time) else f"{head} waits for {item.needs} to arrive"
        if ("start", (rank, i)) not in time:
            prev = self.prev_stream[rank, i]
            if prev is not None and ("done", prev) not in time:
                return f"{head} waits behind {self.programs[prev[0]][prev[1]]} on its stream"
            r, k = self.prev_compute[rank, i]
            return f"{head} waits for {self.programs[r][k]}"
        missing = [t for j, t in enumerate(item.transfers) if ("start", self.partner[(rank, i), j]) not in time]
        return f"{head}: no matching post started for " + ", ".join(map(str, missing))
