"""Deferred weight gradients for zero-bubble pipeline schedules (ZB-H1, Qi et al. 2023).

ZB-H1 splits a micro-batch's backward into B (input gradients, on the critical path between stages)
and W (weight gradients, scheduled later to fill the bubble). The pipeline engine owns one
:class:`WeightGradStore` and hands it to the tensor-parallel linear layers (their ``weight_grad_store``
attribute). While the store is attached, those layers' backward computes only the input gradient and
queues a closure holding exactly what the weight/bias GEMMs need -- the layer input and the output
gradient -- so no second forward is needed and recomputation stays correct. ``run(key)`` replays a
micro-batch's closures in FIFO order, accumulating into ``param.grad`` (what DeepSpeed's gradient
reduction reads at the end of the step).
"""
from __future__ import annotations

from collections import defaultdict, deque

import torch
import torch.nn.functional as F


class WeightGradStore:
    """Queued weight-gradient GEMMs, per key (the engine uses (chunk, micro))."""

    def __init__(self):
        self.key = None                     # set by the engine around each B
        self._queues = defaultdict(deque)

    def put(self, closure) -> None:
        if self.key is None:
            raise RuntimeError("a deferred weight gradient was produced outside a B pass")
        self._queues[self.key].append(closure)

    @torch.no_grad()    # as inside autograd's backward: W builds no graph
    def run(self, key) -> None:
        queue = self._queues.pop(key, deque())
        while queue:
            queue.popleft()()

    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def accumulate_linear_grads(weight: torch.Tensor, bias: torch.Tensor | None, grad: torch.Tensor,
                            x: torch.Tensor) -> None:
    """W of ``y = x Wᵀ + b``: add ``gradᵀ x`` to ``weight.grad`` and ``Σ grad`` to ``bias.grad``."""
    g = grad.reshape(-1, grad.shape[-1])
    _accumulate(weight, g.t().matmul(x.reshape(-1, x.shape[-1])))
    if bias is not None:
        _accumulate(bias, g.sum(0))


class _LinearWithDeferredWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.store = store
        ctx.save_for_backward(x, weight)
        # The parameters themselves, for param.grad: under non-reentrant recomputation the saved
        # tensors come back as recomputed aliases, whose .grad DeepSpeed never reads.
        ctx.param, ctx.bias = weight, bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        param, bias = ctx.param, ctx.bias
        grad_input = grad.matmul(weight) if ctx.needs_input_grad[0] else None

        ctx.store.put(lambda: accumulate_linear_grads(param, bias, grad, x))
        return grad_input, None, None, None


def linear_with_deferred_weight_grad(x, weight, bias, store):
    """``F.linear(x, weight, bias)`` whose weight/bias gradients are queued on ``store`` (if not None)."""
    if store is None:
        return F.linear(x, weight, bias)
    return _LinearWithDeferredWeightGrad.apply(x, weight, bias, store)
