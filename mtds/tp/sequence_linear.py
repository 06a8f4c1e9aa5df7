"""Linear layer on an all-gathered sequence-parallel input that keeps only this rank's slice for backward.

With sequence parallelism the input of a column-parallel linear (and of the LM head) is this rank's
sequence slice [b, s/t, h]; the matmul needs the whole sequence. Letting autograd save the gathered
[b, s, h] tensor would keep t times the activation Korthikanti et al. (2022, Section 4.2.2) count for
it (2sbh/t per linear in their 34sbh/t). Like Megatron, save the slice and all-gather it again in
backward for the weight gradient; the input gradient is reduce-scattered back to the slice.

With a :class:`~mtds.tp.weight_grad_store.WeightGradStore` (ZB-H1) the backward does only the input
gradient; the re-gather and the weight/bias GEMMs are queued for W, so the slice -- not the gathered
sequence -- is what waits for W (every TP rank runs the same W order, so the all-gathers match).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mtds.tp.mappings import _gather, _reduce_scatter, _start_gather, _start_reduce_scatter, _world
from mtds.tp.weight_grad_store import accumulate_linear_grads, linear_with_deferred_weight_grad

SEQUENCE_DIM = 1   # activations are [batch, sequence, hidden]


class _LinearWithSequenceParallelInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, store):
        ctx.group, ctx.has_bias, ctx.store = group, bias is not None, store
        ctx.save_for_backward(x, weight)
        # The parameters themselves for a deferred W (see weight_grad_store: recomputation's aliases).
        ctx.param, ctx.bias = weight, bias
        return F.linear(_gather(x, group, SEQUENCE_DIM), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if ctx.store is not None:
            return _backward_deferring_weight_grad(ctx, x, weight, grad)
        grad_input = grad_weight = grad_bias = None
        # The extra all-gather of the trade runs while the input-gradient GEMM computes, and the
        # input gradient's reduce-scatter while the weight-gradient GEMM computes (as Megatron does).
        gathering = _start_gather(x, ctx.group, SEQUENCE_DIM) if ctx.needs_input_grad[1] else None
        partial = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        # one collective in flight per group: the gather completes before the reduce-scatter starts
        full = gathering.wait() if gathering is not None else None
        scattering = _start_reduce_scatter(partial, ctx.group, SEQUENCE_DIM) if partial is not None else None
        if ctx.needs_input_grad[1]:
            grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(full.reshape(-1, full.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        if scattering is not None:
            grad_input = scattering.wait()
        return grad_input, grad_weight, grad_bias, None, None


def _backward_deferring_weight_grad(ctx, x, weight, grad):
    """B: the input gradient only; W (queued): re-gather the slice, weight and bias GEMMs."""
    grad_input = None
    if ctx.needs_input_grad[0]:
        grad_input = _reduce_scatter(grad.matmul(weight), ctx.group, SEQUENCE_DIM)
    param, bias, group = ctx.param, ctx.bias, ctx.group

    ctx.store.put(lambda: accumulate_linear_grads(param, bias, grad, _gather(x, group, SEQUENCE_DIM)))
    return grad_input, None, None, None, None


def linear_with_sequence_parallel_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                        group, store=None) -> torch.Tensor:
    """``F.linear(all_gather_sequence(x), weight, bias)`` storing only ``x`` (the slice) for backward;
    weight/bias gradients queued on ``store`` (a WeightGradStore) if given."""
    if _world(group) == 1:
        return linear_with_deferred_weight_grad(x, weight, bias, store)
    return _LinearWithSequenceParallelInput.apply(x.contiguous(), weight, bias, group, store)
