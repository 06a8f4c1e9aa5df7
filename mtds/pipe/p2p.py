"""Point-to-point transfers between virtual pipeline stages, for the schedules mtds runs itself.

Semantics (those ``mtds.pipe.schedules`` assumes): a send never blocks -- ``isend`` is posted and its
handle kept until :meth:`StageP2P.wait_sends` at the end of the step; a receive blocks (``irecv`` then
``wait``) only when the compute that needs it is next. With both, no schedule order can deadlock on
message ordering. Activations and gradients travel on two different process groups over the same
pipeline ranks, so a pair of ranks that exchanges both (p = 2, or rank p−1 → 0) never confuses one for
the other, on gloo (tags) and on NCCL (which matches p2p in issue order per communicator).

Scatter/gather (PTD-P §4.1): with tensor parallelism the boundary activation (and its gradient) is the
same on every TP rank, so each TP rank sends only its 1/t slice and the receiver all-gathers the slices
over the TP group. Off with sequence parallelism: the activation is already one slice per TP rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

ACTIVATION_TAG, GRADIENT_TAG = 1, 2


class StageP2P:
    """Sends/receives of one pipeline rank. ``grid``: DeepSpeed's PipelineParallelGrid (stage → global
    rank); ``act_group``/``grad_group``: this rank's pipeline group and a second one over the same ranks;
    ``shape``/``dtype``: the boundary activation of one micro-batch; ``tp_group``/``tp_size``: for
    scatter/gather (``scatter_gather`` False: whole tensors)."""

    def __init__(self, grid, *, act_group, grad_group, shape, dtype, device, tp_group=None, tp_size: int = 1,
                 scatter_gather: bool = False):
        self.grid, self.act_group, self.grad_group = grid, act_group, grad_group
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

    # -- public: the four transfers of a schedule -------------------------------------------------------
    def send_forward(self, tensor: torch.Tensor, stage: int) -> None:
        self._send(tensor, stage, self.act_group, ACTIVATION_TAG)

    def recv_forward(self, stage: int) -> torch.Tensor:
        return self._recv(stage, self.act_group, ACTIVATION_TAG).requires_grad_()

    def send_backward(self, grad: torch.Tensor, stage: int) -> None:
        self._send(grad, stage, self.grad_group, GRADIENT_TAG)

    def recv_backward(self, stage: int) -> torch.Tensor:
        return self._recv(stage, self.grad_group, GRADIENT_TAG)

    def wait_sends(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []

    # -- the wire ---------------------------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, stage: int, group, tag: int) -> None:
        if tuple(tensor.shape) != self.shape:
            raise RuntimeError(f"stage boundary has shape {tuple(tensor.shape)}, expected {self.shape}")
        payload = tensor.detach().reshape(-1)
        if self.scatter_gather:
            part = self.numel // self.tp_size
            rank = dist.get_rank(self.tp_group)
            payload = payload[rank * part:(rank + 1) * part]
        payload = payload.to(self.dtype).contiguous()
        work = dist.isend(payload, self.grid.stage_to_global(stage), group=group, tag=tag)
        self.pending.append((work, payload))

    def _recv(self, stage: int, group, tag: int) -> torch.Tensor:
        part = self.numel // self.tp_size if self.scatter_gather else self.numel
        buffer = torch.empty(part, dtype=self.dtype, device=self.device)
        dist.irecv(buffer, self.grid.stage_to_global(stage), group=group, tag=tag).wait()
        if self.scatter_gather:
            full = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            dist.all_gather(list(full.chunk(self.tp_size)), buffer, group=self.tp_group)
            buffer = full
        return buffer.view(self.shape)
