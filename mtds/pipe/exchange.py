"""The point-to-point program of one pipeline rank: every compute action and every p2p post, in the order
the host issues them, each transfer on a named process group. One pure function,
:func:`engine_program`, that ``ScheduledPipelineEngine`` walks (it posts exactly these transfers, in this
order, on these groups) and that ``lab.pipe_sim.nccl_sim`` checks, so what the simulator proves about the
order is what the engine runs.

Messages. Virtual stage ``s = chunk·p + rank`` (``mtds.pipe.schedules``). F of a stage that is not the
first consumes ``act(s − 1, i)`` (the previous stage's output activation of micro-batch ``i``) and F of a
stage that is not the last produces ``act(s, i)`` for stage ``s + 1``; B of a stage that is not the last
consumes ``grad(s + 1, i)`` and B of a stage that is not the first produces ``grad(s, i)`` (its input
gradient) for stage ``s − 1``.

Policies (``POLICIES``):

- ``one-way`` (the engine's; the default). A message travels on the group of its kind and of its
  sender's *colour*: ``act0``, ``act1`` (``act2``), ``grad0``, ... Colours alternate along the ring of
  pipeline ranks (``r % 2``; for odd p rank p − 1 gets colour 2, since its activations go to rank 0 when
  v ≥ 2), so on every group a rank only sends, to one peer, or only receives, from one peer: each NCCL
  stream of a rank carries one direction of one rank pair. Each transfer is a lone ``isend``/``irecv``;
  a send is posted right after the compute that produced it; a receive one compute early (before the
  compute issued before the one that needs it, so the transfer runs during that compute), never ahead
  of an earlier post on its group, nor a rank's first transfer on a group ahead of its first transfer
  on another (under torch's lazy initialisation a first transfer creates the pair's NCCL communicator,
  the host waiting for the peer: two ranks creating two communicators in opposite orders would hang).
  Proof that no NCCL order can deadlock: docs/pipeline.md, "p2p under NCCL".
- ``two-groups`` -- the engine before the NCCL fix: activations on one group, gradients on another, each
  receive posted right before its compute. Fine on gloo (buffered sends), but on NCCL two crossing sends
  of one rank pair on one group deadlock (interleaved at p = 2; ``lab.pipe_sim.nccl_sim`` shows it). Kept
  so that the check can be seen to catch it.
"""
from __future__ import annotations

from dataclasses import dataclass

from mtds.pipe.schedules import Action, forward_actions, schedule_actions

ACT, GRAD = "act", "grad"
POLICIES = ("one-way", "two-groups")


@dataclass(frozen=True)
class Message:
    """``kind`` ``act``: the output activation of virtual stage ``stage`` (sent to ``stage + 1``);
    ``grad``: the input gradient of ``stage`` (sent to ``stage − 1``). One micro-batch's."""
    kind: str
    stage: int
    micro: int

    def __str__(self):
        return f"{self.kind}(stage {self.stage}, micro {self.micro})"


@dataclass(frozen=True)
class Transfer:
    """One send or receive of ``message`` with pipeline rank ``peer`` on process group ``group`` (a name
    of :func:`group_names`)."""
    op: str          # "send" | "recv"
    peer: int
    message: Message
    group: str

    def __str__(self):
        return f"{self.op} {self.message} {'to' if self.op == 'send' else 'from'} rank {self.peer} on {self.group}"


@dataclass(frozen=True)
class Post:
    """Transfers posted together: ``batched``, one ``batch_isend_irecv`` (one group); else one lone
    ``isend``/``irecv`` (then exactly one transfer)."""
    transfers: tuple
    batched: bool = False

    @property
    def group(self) -> str:
        return self.transfers[0].group

    def __str__(self):
        return ("batch [" if self.batched else "[") + "; ".join(map(str, self.transfers)) + "]"


@dataclass(frozen=True)
class Compute:
    """A compute action; ``needs``: the message it waits for (None: none); ``makes``: the message it
    produces for a later send (None: none)."""
    action: Action
    needs: Message | None
    makes: Message | None

    def __str__(self):
        a = self.action
        return f"{a.kind}(chunk {a.chunk}, micro {a.micro})"


def colour(sender: int, p: int) -> int:
    """Colour of a sending pipeline rank: neighbours on the ring differ (``r % 2``; 3 colours for odd p)."""
    return 2 if p % 2 and p > 1 and sender == p - 1 else sender % 2


def group_names(p: int, v: int, policy: str = "one-way") -> list[str]:
    """The process groups (each over the pipeline's ranks) the program of a (p, v) pipeline sends on."""
    names = {_group(Message(kind, stage, 0), p, policy) for stage in range(p * v)
             for kind in (ACT, GRAD) if (stage < p * v - 1 if kind == ACT else stage > 0)}
    return sorted(names)


def messages(action: Action, *, p: int, v: int, rank: int) -> tuple:
    """(needs, makes) of one compute action (see the module docstring)."""
    stage, last = action.chunk * p + rank, p * v - 1
    if action.kind == "F":
        return (Message(ACT, stage - 1, action.micro) if stage > 0 else None,
                Message(ACT, stage, action.micro) if stage < last else None)
    if action.kind == "B":
        return (Message(GRAD, stage + 1, action.micro) if stage < last else None,
                Message(GRAD, stage, action.micro) if stage > 0 else None)
    return None, None   # W: local


def _group(message: Message, p: int, policy: str) -> str:
    return message.kind if policy == "two-groups" else f"{message.kind}{colour(message.stage % p, p)}"


def _transfer(op: str, message: Message, *, p: int, policy: str) -> Transfer:
    sender = message.stage % p
    receiver = (message.stage + (1 if message.kind == ACT else -1)) % p
    return Transfer(op, receiver if op == "send" else sender, message, _group(message, p, policy))


def engine_program(name: str, p: int, v: int, m: int, rank: int, *, forward_only: bool = False) -> list:
    """What ``ScheduledPipelineEngine`` runs for one step of schedule ``name`` (``forward_only``: one
    evaluation step): the one call site of the engine, and what ``lab.pipe_sim.nccl_sim`` checks."""
    order = forward_actions if forward_only else schedule_actions
    return exchange_program(order(name, p, v, m, rank), p=p, v=v, rank=rank)


def exchange_program(actions, *, p: int, v: int, rank: int, policy: str = "one-way") -> list:
    """``Post`` and ``Compute`` items of pipeline rank ``rank`` in issue order, for its compute order
    ``actions`` (``schedule_actions`` or ``forward_actions``)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown p2p policy {policy!r}; choose one of {', '.join(POLICIES)}")
    program, firsts = [], {}     # firsts: group -> the rank's first post on it
    for action in actions:
        needs, makes = messages(action, p=p, v=v, rank=rank)
        if needs is not None:
            post = Post((_transfer("recv", needs, p=p, policy=policy),))
            if policy == "one-way":
                _post_one_compute_early(program, post, firsts)
            else:
                program.append(post)
            firsts.setdefault(post.group, post)
        program.append(Compute(action, needs, makes))
        if makes is not None:
            program.append(Post((_transfer("send", makes, p=p, policy=policy),)))
            firsts.setdefault(program[-1].group, program[-1])
    return program


def _post_one_compute_early(program: list, post: Post, firsts: dict) -> None:
    """Append ``post`` (a receive for the compute that comes next) before the compute issued last, so the
    transfer can run during it -- unless a post on the same group was issued after that compute (each
    group keeps its transfers in message order), or ``post`` is the rank's first on its group and a first
    post on another group was issued after that compute (the rank creates its communicators in the
    order its computes need them), or there is no compute."""
    first = post.group not in firsts
    j = len(program)
    while j and isinstance(program[j - 1], Post):
        other = program[j - 1]
        if other.group == post.group or (first and firsts.get(other.group) is other):
            program.append(post)
            return
        j -= 1
    if j:
        program.insert(j - 1, post)
    else:
        program.append(post)
