"""Gradients of parameters shared by the sequence shards (sequence parallelism, Korthikanti et al. 2022).

A replicated parameter applied to this rank's slice of the sequence (layer norms, the row-parallel
bias) gets only this slice's part of its gradient; the TP ranks' parts must be summed. Two ways:

- per use: the parameter enters the forward through an identity whose backward all-reduces its
  gradient over the TP group (one small all-reduce per parameter per micro-batch);
- once per step (Megatron's ``allreduce_sequence_parallel_grads``): the forward uses the parameter
  as is, the slices' gradients accumulate locally over the micro-batches, and one flat all-reduce
  sums them at the gradient-accumulation boundary, before the data-parallel reduction and clipping.

Once per step needs the accumulated gradient to be in ``param.grad`` at the boundary. A parameter
takes that route only when marked ``sequence_parallel_grads_deferred`` (the trainer marks them when
its DeepSpeed path keeps gradients there, see :mod:`mtds.training.sequence_grad_hook`).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from mtds.tp.mappings import copy_to_tensor_parallel_region


def mark_sequence_parallel(param: torch.Tensor | None) -> None:
    """Megatron's attribute: a replicated parameter whose gradient is a partial sum over sequence slices."""
    if param is not None:
        param.sequence_parallel = True


def shared_by_sequence_shards(param: torch.Tensor | None, group) -> torch.Tensor | None:
    """The parameter as this rank's sequence slice uses it; sums its gradient per use unless deferred."""
    if param is None or getattr(param, "sequence_parallel_grads_deferred", False):
        return param
    return copy_to_tensor_parallel_region(param, group)


def allreduce_sequence_parallel_grads(params: Sequence[torch.Tensor], group) -> None:
    """Sum the accumulated gradients of ``params`` over the TP group in one flat all-reduce."""
    if not params or group is None or dist.get_world_size(group) == 1:
        return
    missing = [tuple(p.shape) for p in params if p.grad is None]
    if missing:
        raise RuntimeError(f"sequence-parallel parameters without a gradient at the step boundary {missing}: "
                           "the DeepSpeed path moved them elsewhere; their sum over TP ranks would be lost")
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(summed)
