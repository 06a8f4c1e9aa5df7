"""Aux-loss-free load balancing (DeepSeek-V3; Megatron-core's ``--moe-router-enable-expert-bias
--moe-router-bias-update-rate``): after each optimizer step every MoE block's expert bias (the fp32
``e_score_correction_bias`` its router adds to the scores for the choice only, mtds.model.router) moves by
rate · sign(mean load − load of the expert), the loads being the step's token-to-expert assignments of that block
over all its micro-batches, summed over the data-parallel ranks (expert-parallel ones included: they route their
own tokens). Every tensor- and context-parallel rank holds the whole sequence's counts already (the block sums them
over the sequence-parallel slices and the context-parallel chunks, mtds.model.moe), so every rank of the stage
makes the same update and the biases stay bit-equal everywhere. transformers keeps the bias as a buffer and never moves it.

The counts are the step log's (:mod:`mtds.training.expert_load`: noted once per training forward, not again in a
recomputation's replay). The bias is a persistent buffer, so DeepSpeed's checkpoints save and resume it with the
module's state.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def update_expert_biases(blocks: list, rate: float, dp_group) -> None:
    """One step's update of every block's bias (collective over ``dp_group``: one all-reduce for all blocks)."""
    blocks = [b for b in blocks if b.router.e_score_correction_bias is not None]
    if not blocks or not rate:
        return
    bias0 = blocks[0].router.e_score_correction_bias
    loads = torch.stack([torch.zeros_like(b.router.e_score_correction_bias, dtype=torch.float64) + b.tokens_seen
                         for b in blocks]).to(bias0.device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(loads, group=dp_group)
    step = torch.sign(loads.mean(dim=-1, keepdim=True) - loads).to(torch.float32) * rate
    with torch.no_grad():
        for block, delta in zip(blocks, step):
            block.router.e_score_correction_bias.add_(delta)
