"""Linear layer on an all-gathered sequence-parallel input that keeps only this rank's slice for backward.

With sequence parallelism the input of a column-parallel linear (and of the LM head) is this rank's
sequence slice [b, s/t, h]; the matmul needs the whole sequence. Letting autograd save the gathered
[b, s, h] tensor would keep t times the activation Korthikanti et al. (2022, Section 4.2.2) count for
it (2sbh/t per linear in their 34sbh/t). Like Megatron, save the slice and all-gather it again in
backward for the weight gradient; the input gradient is reduce-scattered back to the slice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .mappings import _gather, _start_gather, _start_reduce_scatter, _world

SEQUENCE_DIM = 1   # activations are [batch, sequence, hidden]


class _LinearWithSequenceParallelInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather(x, group, SEQUENCE_DIM), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        # The extra all-gather of the trade runs while the input-gradient GEMM computes, and the
        # input gradient's reduce-scatter while the weight-gradient GEMM computes (as Megatron does).
        gathering = _start_gather(x, ctx.group, SEQUENCE_DIM) if ctx.needs_input_grad[1] else None
        scattering = None
        if ctx.needs_input_grad[0]:
            partial = grad.matmul(weight)
            full = gathering.wait() if gathering is not None else None
            scattering = _start_reduce_scatter(partial, ctx.group, SEQUENCE_DIM)
        elif gathering is not None:
            full = gathering.wait()
        if ctx.needs_input_grad[1]:
            grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(full.reshape(-1, full.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        if scattering is not None:
            grad_input = scattering.wait()
        return grad_input, grad_weight, grad_bias, None


def linear_with_sequence_parallel_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                        group) -> torch.Tensor:
    """``F.linear(all_gather_sequence(x), weight, bias)`` storing only ``x`` (the slice) for backward."""
    if _world(group) == 1:
        return F.linear(x, weight, bias)
    return _LinearWithSequenceParallelInput.apply(x.contiguous(), weight, bias, group)
