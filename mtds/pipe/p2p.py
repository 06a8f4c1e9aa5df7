"""Point-to-point transfers between virtual pipeline stages, for the schedules mtds runs itself.

:class:`StageP2P` posts the items of ``mtds.pipe.exchange.exchange_program``: the engine walks that
program and hands each ``Post`` here, and each transfer goes out as a lone ``isend``/``irecv`` on the
process group the program names. A send's handle and tensor
are kept until :meth:`StageP2P.wait_sends` at the end of the step; a receive is waited for only when the
compute that needs it takes it (:meth:`StageP2P.take`).

Deadlock. On gloo sends are buffered and every transfer progresses on its own, so no order can
deadlock. On NCCL a large send completes only once its receive has started, and a rank's p2p on one
communicator run one after the other on one stream: two crossing sends of a rank pair on one group
deadlock (the engine's order before the fix did, interleaved at p = 2). The program's groups are chosen
so that every stream carries one direction of one rank pair, which cannot deadlock under NCCL
(``mtds.pipe.exchange``; proof and check: ``lab.pipe_sim.nccl_sim``, docs/pipeline.md "p2p under NCCL").
Tags (activation or gradient) only matter to gloo; NCCL matches in issue order per communicator.

Scatter/gather (PTD-P §4.1): with tensor parallelism the boundary activation (and its gradient) is the
same on every TP rank, so each TP rank sends only its 1/t slice and the receiver all-gathers the slices
over the TP group. Off with sequence parallelism: the activation is already one slice per TP rank.

Tensors beside the activation (``beside``; an MoE model's router statistics, :mod:`mtds.model.router_carry`,
then packed documents' segment ids, :mod:`mtds.model.documents`):
the stage output is then a tuple (activation, *beside) and its input gradient a tuple (activation's, those of
the beside tensors that have one). Each goes as its own transfer, right after the activation's, on the same
group, to the same peer, in its own dtype and whole: a message stays a run of transfers on one group, so the
order argument above is unchanged.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mtds.pipe.exchange import ACT, Message, Post

ACTIVATION_TAG, GRADIENT_TAG = 1, 2


class StageP2P:
    """Sends/receives of one pipeline rank. ``grid``: DeepSpeed's PipelineParallelGrid (stage → global
    rank); ``groups``: ``exchange.group_names`` → this rank's process group of that name, each over the
    pipeline's ranks; ``shape``/``dtype``: the boundary activation of one micro-batch;
    ``tp_group``/``tp_size``: for scatter/gather (``scatter_gather`` False: whole tensors); ``beside``:
    (shape, dtype, has a gradient) of each tensor that travels after the activation (see the module docstring)."""

    def __init__(self, grid, *, groups: dict, shape, dtype, device, tp_group=None, tp_size: int = 1,
                 scatter_gather: bool = False, beside: tuple = ()):
        self.grid, self.groups = grid, groups
        self.beside = tuple((tuple(s), t, g) for s, t, g in beside)
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.tp_group, self.tp_size = tp_group, tp_size
        self.scatter_gather = scatter_gather and tp_size > 1
        numel = 1
        for n in self.shape:
            numel *= n
        if self.scatter_gather and numel % tp_size:
            raise ValueError(f"scatter/gather needs the stage boundary ({numel} elements) divisible by tp={tp_size}")
        self.numel = numel
        self.pending: list[tuple] = []   # (work handle, tensor kept alive until the send completes)
        self.inbox: dict = {}            # Message -> [(receive buffer, work handle)], until a compute takes it

    # -- public ------------------------------------------------------------------------------------------
    def post(self, post: Post, outbox: dict) -> None:
        """Post the transfer of ``post`` (a lone one: the engine's program batches nothing); a send's
        tensor is ``outbox.pop(message)``, the boundary activation or input gradient its compute produced."""
        if post.batched or len(post.transfers) != 1:
            raise ValueError(f"StageP2P posts lone transfers, got {post}")
        (transfer,) = post.transfers
        group = self.groups[transfer.group]
        tag = ACTIVATION_TAG if transfer.message.kind == ACT else GRADIENT_TAG
        peer = self.grid.stage_to_global(transfer.peer)
        act = transfer.message.kind == ACT
        if transfer.op == "send":
            tensors = self._payloads(outbox.pop(transfer.message), act)
            self.pending += [(dist.isend(t, peer, group=group, tag=tag), t) for t in tensors]
            return
        if transfer.message in self.inbox:
            raise RuntimeError(f"{transfer.message} received twice in one step")
        buffers = [torch.empty(self._part(), dtype=self.dtype, device=self.device)]
        buffers += [torch.empty(s, dtype=t, device=self.device) for s, t, grad in self.beside if act or grad]
        self.inbox[transfer.message] = [(b, dist.irecv(b, peer, group=group, tag=tag)) for b in buffers]

    def take(self, message: Message):
        """The received ``message``, waited for (and all-gathered over TP with scatter/gather): a tensor, or
        with ``beside`` a tuple (see the module docstring); activations require a gradient."""
        received = self.inbox.pop(message)
        for _, work in received:
            work.wait()
        buffer = received[0][0]
        if self.scatter_gather:
            full = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            dist.all_gather(list(full.chunk(self.tp_size)), buffer, group=self.tp_group)
            buffer = full
        tensors = [buffer.view(self.shape)] + [b for b, _ in received[1:]]
        if message.kind == ACT:
            tensors = [t.requires_grad_() if t.is_floating_point() else t for t in tensors]
        return tensors[0] if not self.beside else tuple(tensors)

    def wait_sends(self) -> None:
        if self.inbox:
            raise RuntimeError(f"received but never used: {', '.join(map(str, self.inbox))}")
        for work, _ in self.pending:
            work.wait()
        self.pending = []

    # -- the wire ---------------------------------------------------------------------------------------
    def _part(self) -> int:
        return self.numel // self.tp_size if self.scatter_gather else self.numel

    def _payloads(self, made, act: bool) -> list:
        """The tensors on the wire for a stage output (``act``) or input gradient ``made``."""
        if not self.beside:
            return [self._payload(made)]
        specs = [spec for spec in self.beside if act or spec[2]]
        if not isinstance(made, (tuple, list)) or len(made) != 1 + len(specs):
            raise RuntimeError(f"stage boundary should be a tensor and {len(specs)} beside it, got {type(made)}")
        out = [self._payload(made[0])]
        for tensor, (shape, dtype, _) in zip(made[1:], specs):
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise RuntimeError(f"a tensor beside the stage boundary is {tuple(tensor.shape)} {tensor.dtype}, "
                                   f"expected {shape} {dtype}")
            out.append(tensor.detach().contiguous())
        return out

    def _payload(self, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != self.shape:
            raise RuntimeError(f"stage boundary has shape {tuple(tensor.shape)}, expected {self.shape}")
        payload = tensor.detach().reshape(-1)
        if self.scatter_gather:
            part = self._part()
            rank = dist.get_rank(self.tp_group)
            payload = payload[rank * part:(rank + 1) * part]
        return payload.to(self.dtype).contiguous()
