"""The gradient norm on a pipeline stage without MoE blocks, when other stages hold experts, at ZeRO-1/2 in
fp32, fp16 and bf16 (docs/moe.md).

Every optimizer DeepSpeed 0.19.8 builds there takes the norm in groups, and the expert groups' norms run
collectives over groups that span the stages. A stage holding MoE blocks has the dense group and the expert
group(s) that ``split_params_into_different_moe_groups_for_optimizer`` appended; a stage without has the dense
group only. Left alone, the stages run a different number of all-reduces over a shared group (a hang, or a sum
of the wrong tensors), and the stage without experts would clip by a norm without the experts. So the stage
without experts runs, for each expert group the others hold, what DeepSpeed runs for it with no gradient,
and combines the groups as DeepSpeed does: every stage then clips by the same norm, the one-pipeline-less run's.

* ``DeepSpeedZeroOptimizer`` (fp32 and fp16 ZeRO-1/2, bf16 ZeRO-2): ``scaled_global_norm`` takes one norm per
  param group (``get_grad_norm_direct``), each summed by an all-reduce over the optimizer's model-parallel group
  (on a pipeline it spans the stages), then averages each expert group's norm over its expert-data-parallel
  group (``_average_expert_grad_norms``). Here: a zero sum all-reduced over the model-parallel group (so it
  receives the expert squares of every stage), the root, the average over the expert-data-parallel group.
* ``BF16_Optimizer`` (bf16 ZeRO-1 with fp32 accumulation): ``step`` takes the dense norm, and only where the
  stage has MoE layers ``get_norm_with_moe_layers``: per expert group name ``get_global_norm_of_tensors`` with
  the expert-parallel group, an all-reduce over the pipeline group (the model-parallel one with expert tensor
  parallelism) then over the expert-parallel group, the groups combined on the host. Here the stage takes that
  same path with one zero tensor for each expert group name: DeepSpeed's own functions run the collectives
  (both all-reduces are needed: the stage's expert-parallel sum gathers what each rank received over the
  pipeline group) and the combination, so both stages' norms are equal bit for bit.
"""
from __future__ import annotations

import torch


def install_stage_expert_norms(engine) -> int:
    """On every rank of an expert-parallel pipeline at ZeRO-1/2 (a collective over the model-parallel group):
    agree on the expert groups a stage holds; a stage without any gets the empty ones. Returns how many empty
    groups this rank runs (0 where it holds experts or no stage does)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    opt = engine.optimizer
    if isinstance(opt, DeepSpeedZeroOptimizer):
        flags = list(getattr(opt, "is_moe_param_group", [])) if opt.has_moe_layers else [False] * len(opt.bit16_groups)
        group = opt.model_parallel_group
    elif type(opt) is BF16_Optimizer:
        from deepspeed.moe.utils import is_moe_param_group
        flags = [bool(opt.has_moe_layers and is_moe_param_group(pg)) for pg in opt.optimizer.param_groups]
        group = opt.mpu.get_model_parallel_group()
    else:
        raise RuntimeError("a pipeline stage without MoE blocks is built for DeepSpeed's ZeRO-1/2 and BF16 "
                           f"optimizers only (this run has {type(opt).__name__})")
    missing = _missing_expert_groups(flags, group)
    if missing == 0:
        return 0
    if isinstance(opt, DeepSpeedZeroOptimizer):
        _zero_empty_expert_norms(opt, missing)
    else:
        _bf16_empty_expert_norms(opt)
    return missing


def _missing_expert_groups(flags: list[bool], group) -> int:
    """How many expert param groups the other stages hold that this one lacks (collective over ``group``)."""
    import torch.distributed as dist
    dense, moe = flags.count(False), flags.count(True)
    if flags != [False] * dense + [True] * moe:
        raise RuntimeError(f"expected DeepSpeed's expert param groups after the dense ones, got {flags}")
    counts = torch.tensor([dense, -dense, moe], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    if counts[0] != -counts[1]:
        raise RuntimeError(f"pipeline stages hold {int(-counts[1])} to {int(counts[0])} dense param groups: "
                           "their norms' collectives would not pair")
    missing = int(counts[2]) - moe
    if missing and moe:
        raise RuntimeError(f"this stage holds {moe} of the {int(counts[2])} expert param groups of another stage")
    return missing


def _expert_group_name() -> str:
    from deepspeed.utils import groups as ds_groups
    names = list(ds_groups._get_expert_data_parallel_group_dict())
    if len(names) != 1:
        raise RuntimeError(f"expected one expert group name, DeepSpeed holds {names}")
    return names[0]


def _zero_empty_expert_norms(opt, missing: int) -> None:
    """DeepSpeedZeroOptimizer's ``scaled_global_norm`` with ``missing`` empty expert groups after the dense ones."""
    import torch.distributed as dist
    from deepspeed.utils import groups as ds_groups
    if opt.cpu_offload:
        raise RuntimeError("a pipeline stage without MoE blocks with ZeRO CPU offload is not built")
    expert_dp = ds_groups._get_expert_data_parallel_group(_expert_group_name())

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


def _bf16_empty_expert_norms(opt) -> None:
    """BF16_Optimizer's ``step`` on the MoE path with one zero tensor per expert group name: its
    ``has_moe_layers`` on, no expert buffers to reduce (``expert_gradients`` empty, as the engine's own
    ``has_moe_layers`` stays off), and its norm selection given the zero for each name."""
    if opt.norm_type != 2:
        raise RuntimeError("a pipeline stage without MoE blocks in bf16 is built for the 2-norm only")
    name = _expert_group_name()
    device = opt.fp32_groups_gradients_flat[0].device
    zero = torch.zeros(1, dtype=torch.float32, device=device)
    select = opt.get_grads_for_norm        # DeepSpeed's, or mtds's reduce-scatter's (bf16_reduce.py)

    def grads_for_norm(for_clipping=False):
        if for_clipping:
            return select(for_clipping=True)
        dense, experts = select(for_clipping=False)
        if experts:
            raise RuntimeError(f"a stage without MoE param groups selected expert gradients: {list(experts)}")
        return dense, {name: [zero]}

    opt.has_moe_layers = True
    opt.expert_gradients = {}
    opt.get_grads_for_norm = grads_for_norm
