"""One optimizer step and one evaluation pass, for the pipeline engine and the plain engine alike.

Both return the mean next-token loss over the whole global batch (every micro-batch of every
data-parallel rank, equal sizes), identical on all ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mtds.parallel.layout import ParallelGroups

from mtds.training.batches import DeviceBatches
from mtds.observe.ranges import profiler_range


def _mean_over_data_parallel(loss: torch.Tensor, groups: ParallelGroups) -> float:
    loss = loss.detach().float().reshape(1).clone()
    if groups.layout.dp_cp > 1:   # with context parallelism each rank's loss is its weighted part (LMLoss)
        dist.all_reduce(loss, group=groups.dp_cp_group)
        loss /= groups.layout.dp_cp
    return loss.item()


def _stage_data(stream, groups: ParallelGroups, accumulation: int, device):
    """Only the first (inputs) and last (labels) pipeline stages read data: this step's micro-batches,
    already on the device."""
    if not (groups.is_first_stage or groups.is_last_stage):
        return None
    return DeviceBatches(stream, device, accumulation)


def train_step(engine, stream, groups: ParallelGroups, accumulation: int, device) -> float:
    if groups.layout.pp > 1:
        # The engine runs 1F1B over `accumulation` micro-batches and averages loss over them and DP.
        with profiler_range("mtds.train_batch"):
            return float(engine.train_batch(data_iter=_stage_data(stream, groups, accumulation, device)))
    losses = []
    batches = DeviceBatches(stream, device, accumulation)
    for _ in range(accumulation):
        input_ids, labels = next(batches)      # an endless iterator: the count bounds the loop
        # named ranges for torch.profiler (benchmarks/profile_step.py): where a step's time goes
        with profiler_range("mtds.forward"):
            loss = engine(input_ids, labels)
        with profiler_range("mtds.backward"):
            engine.backward(loss)
        with profiler_range("mtds.optimizer"):
            engine.step()  # DeepSpeed applies the optimizer only at the accumulation boundary
        losses.append(loss.detach())
    return _mean_over_data_parallel(torch.stack(losses).mean(), groups)


@torch.no_grad()
def eval_loss(engine, stream, groups: ParallelGroups, accumulation: int, iters: int, device) -> float:
    """Mean loss over ``iters`` global batches drawn from ``stream``."""
    total = 0.0
    if groups.layout.pp > 1:
        for _ in range(iters):
            # eval_batch pulls exactly `accumulation` micro-batches, so slice them off the stream.
            total += float(engine.eval_batch(data_iter=_stage_data(stream, groups, accumulation, device)))
        return total / iters
    engine.module.eval()
    try:
        for _ in range(iters):
            batches = DeviceBatches(stream, device, accumulation)
            losses = [engine(*next(batches)) for _ in range(accumulation)]
            total += _mean_over_data_parallel(torch.stack(losses).mean(), groups)
    finally:
        engine.module.train()
    return total / iters
