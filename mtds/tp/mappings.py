"""Autograd-aware collectives that move activations in and out of tensor-parallel regions.

Megatron (Shoeybi et al. 2019, Fig. 3) needs two conjugate operators per parallel region:
``f`` = identity forward / all-reduce backward (enter a region), ``g`` = all-reduce forward /
identity backward (leave it). Scatter/gather split the last (hidden) dim; the sequence variants
(Korthikanti et al. 2022) reduce-scatter / all-gather along the sequence dim.

The process group is always an explicit argument (``None`` means no tensor parallelism), so these
functions read no global state. Collectives are called through ``torch.distributed`` attributes at
call time, which keeps them visible to :mod:`mtds.observe.comm_trace`.

Under ``--compile`` (while Dynamo traces a layer) the same autograd functions call torch's functional
collectives instead (``torch.distributed._functional_collectives``: a new tensor, its wait in the graph),
which Dynamo keeps in the layer's graph. Each ``async_op=True`` call of the eager path (the gathers, the
reduce-scatters, the overlapped linear's all-reduce) split the graph there: two GPT-2 layers at t = 2 were
11 graphs (15 with sequence parallelism), now 1. The synchronous in-place all-reduce Dynamo rewrites to a
functional one itself; it is called functionally here too, so no in-place result is left for AOTAutograd to
functionalize. Same reductions on the same backend, so the same values; the eager path is untouched.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_gather_single(out, x, group=None, async_op: bool = False):
    """``all_gather_into_tensor`` under its torch >= 2.13 name (the old one warns that it is deprecated);
    looked up at call time so that the collective tracer sees it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, x, group=group, async_op=async_op)


def reduce_scatter_single(out, x, group=None, async_op: bool = False):
    """``reduce_scatter_tensor`` under its torch >= 2.13 name, as :func:`all_gather_single`."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, x, group=group, async_op=async_op)


def _compiling() -> bool:
    """Whether Dynamo is tracing: then a collective must be a functional one to stay in the graph."""
    return torch.compiler.is_compiling()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    x = x.contiguous()
    if _compiling():
        return funcol.all_reduce(x, "sum", group)
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {world} tensor-parallel ranks")
    return x.chunk(world, dim=dim)[_rank(group)].contiguous()


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return _start_gather(x, group, dim).wait()


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return _start_reduce_scatter(x, group, dim).wait()


class _Pending:
    """A collective in flight: ``wait()`` returns its result. Lets a backward start a collective, run a
    GEMM that does not need it, then wait (Megatron overlaps sequence-parallel communication this way)."""

    def __init__(self, out: torch.Tensor, work=None, finish=None):
        self._out, self._work, self._finish = out, work, finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._finish(self._out) if self._finish else self._out


def _start_gather(x: torch.Tensor, group, dim: int) -> _Pending:
    world = _world(group)
    if world == 1:
        return _Pending(x)
    x = x.contiguous()
    # Gather along dim 0 (one contiguous collective), then move the blocks to ``dim``.
    finish = None if dim == 0 or dim == -x.dim() else (
        lambda full: torch.cat(full.chunk(world, dim=0), dim=dim).contiguous())
    if _compiling():    # nothing in flight to hold: the graph orders the collective and its use
        return _Pending(funcol.all_gather_tensor(x, 0, group), None, finish)
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return _Pending(out, all_gather_single(out, x, group, async_op=True), finish)


def _start_reduce_scatter(x: torch.Tensor, group, dim: int) -> _Pending:
    world = _world(group)
    if world == 1:
        return _Pending(x)
    if x.shape[dim] % world:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {world} ranks")
    # Put ``dim`` blocks one after another along dim 0 so one reduce_scatter_tensor does the work.
    stacked = torch.cat(x.chunk(world, dim=dim), dim=0).contiguous()
    if _compiling():
        return _Pending(funcol.reduce_scatter_tensor(stacked, "sum", 0, group))
    out = torch.empty((stacked.shape[0] // world,) + tuple(stacked.shape[1:]), dtype=x.dtype, device=x.device)
    return _Pending(out, reduce_scatter_single(out, stacked, group, async_op=True))


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous() or _compiling():     # compiled: functional, a new tensor
            return _all_reduce(x.contiguous(), group)
        # In place, as Megatron does: the partial sums (a row-parallel GEMM's output) have no other use.
        # mark_dirty makes autograd refuse the one case where that is wrong (x saved by another op).
        ctx.mark_dirty(x)
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, grad.dim() - 1), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group, x.dim() - 1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, -1), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """``f``: identity forward, all-reduce of the gradient backward."""
    return x if _world(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """``g``: all-reduce forward, identity backward."""
    return x if _world(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's chunk of the last dim; backward all-gathers the gradient."""
    return x if _world(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the last dim; backward keeps this rank's chunk of the gradient."""
    return x if _world(group) == 1 else _GatherFromRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence chunk (``g`` with sequence parallelism)."""
    return x if _world(group) == 1 else _ReduceScatterToSequence.apply(x, group, dim % x.dim())


def scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Keep this rank's sequence chunk of a replicated tensor; backward all-gathers the gradient."""
    return x if _world(group) == 1 else _ScatterToSequence.apply(x, group, dim % x.dim())


def gather_from_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """All-gather sequence chunks (``f`` with sequence parallelism); backward reduce-scatters."""
    return x if _world(group) == 1 else _GatherFromSequence.apply(x, group, dim % x.dim())


def _all_to_all_rows(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, backward_group):
        ctx.group, ctx.splits = backward_group, (out_splits, in_splits)
        return _all_to_all_rows(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all_rows(grad, ctx.group, in_splits, out_splits), None, None, None, None


def all_to_all(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int],
               backward_group=None) -> torch.Tensor:
    """Rows ``x`` [sum(in_splits), ...]: ``in_splits[j]`` consecutive rows go to rank j of ``group``, and
    ``out_splits[j]`` rows come from it, in rank order (uneven splits: expert parallelism's token
    exchange). Backward is the same exchange with the splits swapped, on ``backward_group`` (the same ranks;
    None: ``group``) -- a second group lets a backward run beside another chunk's forward on its own thread
    (mtds.deepspeed_compat.dualpipev_overlap) with each group seeing one collective order on every rank."""
    if _world(group) == 1:
        return x
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits),
                           group if backward_group is None else backward_group)
