"""Gradient-norm clipping that is correct for every layout.

The global norm counts each distinct parameter once:
  - TP-sharded parameters (``tensor_model_parallel``) on every TP rank (each rank holds a slice),
  - TP-replicated parameters (norms, row-parallel biases) only on TP rank 0,
  - pipeline-tied copies (``ds_pipe_replicated``, set by DeepSpeed on the non-owning stage) never,
then sums squares over the model-parallel group (tensor x pipeline). Data-parallel replicas hold the
same averaged gradients, so they need no reduction; expert-parallel ranks hold different experts, so the
squares of expert parameters (``expert_parallel``) are first summed over the EP group.

DeepSpeed's own path for fp32 without ZeRO (``clip_grad_norm_``) decides "TP rank 0" with the
pipeline grid's model-parallel rank, which spans pipe x tensor, and so drops replicated parameters
of every stage but the first; mtds replaces it with this function on that path.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

from mtds.deepspeed_compat import patches
from mtds.parallel.layout import ParallelGroups


def global_grad_norm(parameters: Iterable[torch.Tensor], groups: ParallelGroups) -> float:
    parameters = list(parameters)
    squares, expert = None, None
    for p in parameters:
        if p.grad is None or getattr(p, "ds_pipe_replicated", False):
            continue
        if getattr(p, "tensor_model_parallel", False) or groups.tp_rank == 0:
            s = p.grad.detach().float().pow(2).sum()
            if getattr(p, "expert_parallel", False):
                expert = s if expert is None else expert + s
            else:
                squares = s if squares is None else squares + s
    squares = torch.zeros((), device=_device(parameters)) if squares is None else squares
    squares = squares.reshape(1).clone()
    if groups.ep_group is not None:
        expert = torch.zeros_like(squares) if expert is None else expert.reshape(1).clone()
        dist.all_reduce(expert, group=groups.ep_group)
        squares += expert
    if groups.layout.model_parallel_size > 1:
        dist.all_reduce(squares, group=groups.mp_group)
    return math.sqrt(squares.item())


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, groups: ParallelGroups) -> float:
    """Scale gradients in place so the global norm is at most ``max_norm``; return the pre-clip norm."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(parameters, groups)
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for p in parameters:
            p.grad.detach().mul_(coefficient)
    return norm


def _device(parameters) -> torch.device:
    for p in parameters:
        return p.device
    return torch.device("cpu")


def install_fp32_clipping(engine, groups: ParallelGroups) -> None:
    """Replace the engine's fp32/no-ZeRO clipping with :func:`clip_grad_norm` and record the norm.

    Without clipping DeepSpeed computes no norm on this path at all; then measure it just before the
    optimizer step (gradients are reduced over data parallelism by then), so every step reports one.
    """
    params = engine.module.parameters
    if engine.gradient_clipping() > 0:
        patches.replace_fp32_clipping(engine, lambda: clip_grad_norm(params(), engine.gradient_clipping(), groups))
    else:
        patches.measure_before_model_step(engine, lambda: global_grad_norm(params(), groups))


def mark_sharded_gradients(engine, groups: ParallelGroups) -> None:
    """Make DeepSpeed's unfused fp16/bf16 optimizer (ZeRO-0 without a pipeline) count TP shards.

    That optimizer passes ``p.grad.to(p.dtype)`` (the gradient tensor itself) to ``get_weight_norm``,
    which keeps a tensor on TP ranks > 0 only if *it* carries ``tensor_model_parallel``. Gradients do
    not inherit the parameter's attribute, so every shard held by TP ranks > 0 was left out: at
    t = 2 the reported norm read up to 6% low, and clipping used it. Marking each sharded
    parameter's gradient just before the optimizer step restores the global norm.
    """
    if groups.layout.tp == 1:
        return
    sharded = [p for p in engine.module.parameters() if getattr(p, "tensor_model_parallel", False)]

    def mark():
        for p in sharded:
            if p.grad is not None:
                p.grad.tensor_model_parallel = True

    patches.before_optimizer_step(engine, mark)
