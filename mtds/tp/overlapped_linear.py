"""Column-parallel linear whose input-gradient all-reduce runs while the weight-gradient GEMM computes.

Entering a tensor-parallel region (``f``: identity forward, all-reduce of the gradient backward) followed
by ``Y = X Aᵢ + bᵢ`` has a backward of two independent parts: the input gradient ``dY Aᵢ``, which must be
summed over the TP ranks, and the weight gradient ``dYᵀ X``, which stays local. Megatron starts the
all-reduce asynchronously and computes the weight gradient meanwhile (Narayanan et al. 2021, Section 4.2;
``LinearWithGradAccumulationAndAsyncCommunication``); so does this function. The values are those of
``copy_to_tensor_parallel_region`` + ``F.linear``: the same GEMMs on the same operands.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mtds.tp.mappings import _all_reduce, _compiling


class _LinearAllReducingInputGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        work = None
        if ctx.needs_input_grad[0]:
            grad_input = grad.matmul(weight)
            if _compiling():    # functional, in the graph: the compiler places its wait (async_op breaks it)
                grad_input = _all_reduce(grad_input, ctx.group)
            else:
                work = dist.all_reduce(grad_input, group=ctx.group, async_op=True)
        g = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = g.t().matmul(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = g.sum(0)
        if work is not None:
            work.wait()
        return grad_input, grad_weight, grad_bias, None


def linear_all_reducing_input_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                   group) -> torch.Tensor:
    """``F.linear(copy_to_tensor_parallel_region(x, group), weight, bias)``, the gradient all-reduce
    overlapped with the weight-gradient GEMM. ``group``: a TP group of more than one rank."""
    return _LinearAllReducingInputGrad.apply(x, weight, bias, group)
