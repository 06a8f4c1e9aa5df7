"""ZeRO-1/2's gradient norm on a pipeline stage without MoE blocks, when other stages hold experts (docs/moe.md).

DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer.scaled_global_norm`` takes one norm per optimizer param group
(``get_grad_norm_direct``), each summed by an all-reduce over the optimizer's model-parallel group -- on a
pipeline that group spans the stages -- and then averages each expert group's norm over its
expert-data-parallel group (``_average_expert_grad_norms``). A stage holding MoE blocks has the dense group and
the expert group(s) that ``split_params_into_different_moe_groups_for_optimizer`` appended; a stage without has
the dense group only. Left alone, the stages run a different number of all-reduces over the shared group (a
hang, or a sum of the wrong tensors), and the stage without experts would clip by a norm without the experts.

Here the stage without experts runs, for each expert group the others hold, what DeepSpeed runs for it with an
empty partition: a zero sum all-reduced over the model-parallel group (so it receives the expert squares of
every stage), the root, and the average over its expert-data-parallel group; then it combines the groups as
DeepSpeed does. Every stage then clips by the same norm, the one-pipeline-less run's.
"""
from __future__ import annotations

import torch


def install_stage_expert_norms(engine) -> int:
    """On every rank of an expert-parallel pipeline at ZeRO-1/2 (a collective over the optimizer's
    model-parallel group): agree on the expert groups a stage holds; a stage without any gets the empty ones.
    Returns how many empty groups this rank runs (0 where it holds experts or no stage does)."""
    import torch.distributed as dist
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils import groups as ds_groups
    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer):
        raise RuntimeError("a pipeline stage without MoE blocks is built for DeepSpeed's ZeRO-1/2 optimizer only "
                           f"(this run has {type(opt).__name__})")
    flags = list(getattr(opt, "is_moe_param_group", [])) if opt.has_moe_layers else [False] * len(opt.bit16_groups)
    dense, moe = flags.count(False), flags.count(True)
    if flags != [False] * dense + [True] * moe:
        raise RuntimeError(f"expected DeepSpeed's expert param groups after the dense ones, got {flags}")
    group = opt.model_parallel_group
    counts = torch.tensor([dense, -dense, moe], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    if counts[0] != -counts[1]:
        raise RuntimeError(f"pipeline stages hold {int(-counts[1])} to {int(counts[0])} dense param groups: "
                           "their norms' collectives would not pair")
    missing = int(counts[2]) - moe
    if missing == 0:
        return 0
    if moe:
        raise RuntimeError(f"this stage holds {moe} of the {int(counts[2])} expert param groups of another stage")
    if opt.cpu_offload:
        raise RuntimeError("a pipeline stage without MoE blocks with ZeRO CPU offload is not built")
    names = list(ds_groups._get_expert_data_parallel_group_dict())
    if len(names) != 1:
        raise RuntimeError(f"expected one expert group name, DeepSpeed holds {names}")
    expert_dp = ds_groups._get_expert_data_parallel_group(names[0])

    def empty_expert_norm() -> torch.Tensor:
        # get_grad_norm_direct with no gradient: a zero sum (its data-parallel all-reduce stays within this
        # stage, where every rank has none: skipped), summed over the model-parallel group, rooted
        total = torch.tensor(0.0, dtype=torch.float32).to(opt.device)
        opt._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        norm = total.pow(0.5)
        # _average_expert_grad_norms, over this rank's expert-data-parallel group (same size as the experts')
        scaled = norm * 1.0 / dist.get_world_size(group=expert_dp)
        dist.all_reduce(scaled, group=expert_dp)
        return scaled

    def scaled_global_norm(norm_type=2):
        from deepspeed.runtime.utils import combine_grad_norm_groups
        assert norm_type == 2, "only L2 norm supported"
        norm_groups = [opt.get_grad_norm_direct(opt.averaged_gradients[i], opt.params_in_partition[i])
                       for i in range(len(opt.bit16_groups))]
        norm_groups += [empty_expert_norm() for _ in range(missing)]
        return combine_grad_norm_groups(norm_groups, norm_type=norm_type)

    opt.scaled_global_norm = scaled_global_norm
    return missing
