"""Expert-parallel gradients (docs/moe.md): an expert's gradient on this rank already holds the
contributions of every token its EP group sent it (the all-to-all's backward brings them home), so it is
summed over the expert-data-parallel group only (the d/e ranks holding the same experts), then divided by
d like every other gradient: DeepSpeed averages over d, and each rank's loss is the mean over its own
tokens. Summing it over the whole data-parallel group instead would add other experts' gradients to it.

The rest of the model goes through DeepSpeed's own reduction unchanged (mtds.deepspeed_compat.patches.
reduce_apart). The global norm adds the expert squares over the EP group (mtds.training.grad_norm).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from mtds.deepspeed_compat import patches
from mtds.parallel.layout import ParallelGroups


def expert_parameters(module) -> list:
    return [p for p in module.parameters() if getattr(p, "expert_parallel", False) and p.requires_grad]


def reduce_expert_grads(grads: list[torch.Tensor], groups: ParallelGroups) -> None:
    """Sum over the expert-data-parallel group, divide by the data-parallel size (one flat all-reduce)."""
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    if dist.get_world_size(groups.expert_dp_group) > 1:
        dist.all_reduce(flat, group=groups.expert_dp_group)
    flat.div_(groups.layout.dp_cp)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


def install_expert_reduction(engine, groups: ParallelGroups) -> None:
    if groups.layout.ep == 1:
        return
    patches.reduce_apart(engine, expert_parameters(engine.module), lambda grads: reduce_expert_grads(grads, groups))
