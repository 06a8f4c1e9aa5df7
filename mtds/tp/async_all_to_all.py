"""An all-to-all of rows issued without waiting (``--overlap-moe-expert-parallel-comm``): the forward starts
``all_to_all_single(async_op=True)`` and returns its output buffer with a :class:`Pending` handle; the caller
runs independent compute, then :meth:`Pending.wait` before it reads the rows. The backward is the synchronous
exchange with the splits swapped, as :func:`mtds.tp.all_to_all`'s. The rows are the same as the synchronous
exchange's, bit for bit: only when the host waits for them moves."""
from __future__ import annotations

import torch
import torch.distributed as dist


class Pending:
    """An exchange in flight: ``wait`` once, before the output is read. ``span``: a context manager (a
    timeline record) entered when the exchange is issued and left when its wait returns."""

    def __init__(self, span=None):
        self.work = None
        self.keep = None          # the contiguous input, alive until the exchange completes
        self.span = span

    def issued(self, work, keep) -> None:
        self.work, self.keep = work, keep
        if self.span is not None:
            self.span.__enter__()

    def wait(self) -> None:
        if self.work is None:
            raise RuntimeError("the all-to-all was waited for twice, or never started")
        self.work.wait()
        self.work = self.keep = None
        if self.span is not None:
            self.span.__exit__(None, None, None)


class _StartAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, pending, backward_group):
        ctx.group, ctx.splits = backward_group, (out_splits, in_splits)
        source = x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        pending.issued(dist.all_to_all_single(out, source, out_splits, in_splits, group=group, async_op=True), source)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad = grad.contiguous()
        out = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad, in_splits, out_splits, group=ctx.group)
        return out, None, None, None, None, None


def start_all_to_all(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int], span=None,
                     backward_group=None):
    """(output rows, :class:`Pending`): the exchange of :func:`mtds.tp.all_to_all` started; read the output
    only after ``pending.wait()``. ``span``: see :class:`Pending`; ``backward_group``: as
    :func:`mtds.tp.all_to_all`'s."""
    pending = Pending(span)
    back = group if backward_group is None else backward_group
    return _StartAllToAll.apply(x, group, list(out_splits), list(in_splits), pending, back), pending
