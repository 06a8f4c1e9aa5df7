"""Tokens per expert per step in the step record (console, JSONL, TensorBoard): how evenly the router spread
the step's work. Over every (MoE block, expert) pair of the model, the step's token-to-expert assignments
summed over its micro-batches and the data-parallel ranks: ``expert_tokens_min`` / ``_max``, their
``expert_imbalance`` (max / mean: 1 is perfectly even) and ``expert_assignments`` (the total: k x the
step's tokens x the MoE blocks, as dropless routing must give).

The blocks count in :func:`mtds.model.aux_loss.collect_aux_loss` (p = 1) or as they add to the carried
statistics (p > 1, mtds.model.layer), once per training forward (not again in a recomputation's replay).
Every tensor- and context-parallel rank sees the same counts (summed over the sequence-parallel slices and the
context-parallel chunks already, mtds.model.moe), so the sum runs over the data-parallel group; on a pipeline each stage holds its own blocks' rows,
gathered over the pipeline group (a stage may hold none).

With ``--moe-z-loss-coeff`` the record also holds ``moe_z_loss``, as Megatron logs its ``z_loss``
(``track_moe_metrics``): each block's z-loss without the coefficient, averaged over the MoE blocks, the
step's micro-batches and the data-parallel ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class ExpertLoad:
    def __init__(self, blocks: list, num_experts: int, dp_group, pp_group=None, device=None, z_loss: bool = False):
        self.blocks, self.num_experts, self.dp_group, self.pp_group = blocks, num_experts, dp_group, pp_group
        self.z_loss = z_loss
        self.device = blocks[0].router.weight.device if blocks else device

    def reset(self) -> None:
        for block in self.blocks:
            block.tokens_seen, block.z_seen, block.forwards = 0, 0.0, 0

    def fields(self) -> dict[str, float]:
        """Collective over the data-parallel and pipeline groups (every rank calls it after every step)."""
        E = self.num_experts    # columns: E counts, then the z-loss sum and its forwards (one collective)
        counts = torch.zeros(len(self.blocks), E + 2, dtype=torch.float64, device=self.device)
        for row, block in zip(counts, self.blocks):
            row[:E] += block.tokens_seen      # 0 for a block that saw no training forward this step
            row[E] += block.z_seen
            row[E + 1] += block.forwards
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(counts, group=self.dp_group)
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            stages = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(stages, counts.cpu(), group=self.pp_group)
            counts = torch.cat(stages)
        z, counts = counts[:, E:], counts[:, :E]
        low, high, total = counts.min().item(), counts.max().item(), counts.sum().item()
        out = {"expert_tokens_min": low, "expert_tokens_max": high, "expert_assignments": total,
               "expert_imbalance": high / (total / counts.numel()) if total else float("nan")}
        if self.z_loss:   # every block runs every forward: the mean over (block, micro-batch, data rank)
            out["moe_z_loss"] = (z[:, 0].sum() / z[:, 1].sum().clamp(min=1)).item()
        return out
