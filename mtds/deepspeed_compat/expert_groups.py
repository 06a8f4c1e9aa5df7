"""DeepSpeed's own expert-parallel machinery for mtds's MoE blocks (docs/moe.md).

DeepSpeed's engine handles experts -- their gradients reduced over the expert-data-parallel group
(``_reduce_expert_gradients``), their own optimizer groups partitioned over that group by ZeRO-1/2 and the
BF16 optimizer (``split_params_into_different_moe_groups_for_optimizer``), their start-up broadcast within
it -- once two things hold: the model holds an instance of ``deepspeed.moe.layer.MoE`` (the engine's
``has_moe_layers``) and each expert parameter carries its markers ``allreduce = False`` and ``group_name``.
mtds's MoE block keeps transformers' routing, so it is not that class (GShard gating with capacity);
:class:`ExpertGroups` is an instance of it with no parameters and no forward, registered on the model to
turn the engine's handling on, and its ``set_deepspeed_parallelism`` (which the engine calls on every
module that has one) creates DeepSpeed's expert groups from the mpu, as the class itself would with expert
tensor parallelism (experts split over the TP group inside, as mtds's), and holds them equal to mtds's
layout: :func:`create_expert_groups` creates them on every rank before the engine starts (a pipeline stage
without experts registers no ``ExpertGroups``, its DeepSpeed ZeRO would look for MoE param groups, but must
take part in creating the groups). DeepSpeed keeps its groups in module globals for the life of the process, under a name that holds
only E (``ep_size_E``), and would hand a later run in the same process (a library user, the test pool) with
another t or d the first run's groups: a run drops its groups when it ends (:func:`release_expert_groups`,
from mtds.training.job.release), and a run that finds other ranks under the name stops with one line.

Checked against DeepSpeed 0.19.8 (capabilities: "DeepSpeed's expert groups for mtds's MoE blocks").
"""
from __future__ import annotations

from torch import nn


def group_name(ep: int) -> str:
    return f"ep_size_{ep}"      # DeepSpeed's naming (deepspeed.moe.layer.MoE.expert_group_name)


def mark_expert_parameters(params, ep: int) -> None:
    for p in params:
        p.allreduce = False
        p.group_name = group_name(ep)


def expert_groups_module(num_experts: int, layout, experts: dict | None = None) -> nn.Module:
    """``experts``: {name in the model: stacked expert tensor} of this rank, what DeepSpeed's MoE checkpoint
    saves per expert (mtds.deepspeed_compat.expert_checkpoint)."""
    from deepspeed.moe.layer import MoE
    ep = layout.ep

    class ExpertGroups(MoE):
        """An instance of DeepSpeed's MoE class that only declares E experts split over ``ep`` ranks."""

        def __init__(self):
            nn.Module.__init__(self)     # not MoE.__init__: no gate, no experts of its own
            self.num_experts, self.ep_size = num_experts, ep
            self.num_local_experts = num_experts // ep
            self.expert_group_name = group_name(ep)
            self.experts = dict(experts or {})      # a plain dict: references, not parameters of this module

        def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
            # DeepSpeed's _save_moe_checkpoint asks this module alone for its experts (one file per expert);
            # inside the model's own state_dict (a prefix, a destination) it holds nothing
            if not args and destination is None and not prefix:
                from mtds.deepspeed_compat.expert_checkpoint import per_expert_state
                return per_expert_state(self.experts, self.num_local_experts)
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            import torch.distributed as dist
            _check(layout, dist.get_rank())     # created by create_expert_groups before the engine

        def forward(self, *args, **kwargs):
            raise RuntimeError("ExpertGroups only declares the experts to DeepSpeed; it has no forward")

    return ExpertGroups()


def create_expert_groups(layout, mpu) -> None:
    """DeepSpeed's expert groups for ``layout`` (``mpu``: mtds's ParallelGroups), on every rank before the engine
    starts: creating a process group is collective over the world, and on a pipeline a stage without experts
    registers no ``ExpertGroups`` (DeepSpeed's ZeRO then asserts MoE param groups) yet must take part."""
    import torch.distributed as dist
    from deepspeed.utils import groups
    if group_name(layout.ep) not in groups._get_expert_parallel_group_dict():
        # DeepSpeed reads the data-parallel size from its module-global mpu, which its engine sets only later:
        # until then it is an earlier run's in this process (or none: the whole world). This run's, as the
        # engine will set it.
        groups.mpu = mpu
        # mtds's rank order is DeepSpeed's "E + M + D" arrangement (data before expert off)
        groups._create_expert_data_and_model_parallel(layout.ep, mpu=mpu, use_data_before_expert_parallel_=False)
    _check(layout, dist.get_rank())


def _check(layout, rank: int) -> None:
    name = group_name(layout.ep)
    if _theirs(name) != _mine(layout, rank):
        raise RuntimeError(f"DeepSpeed already holds expert groups named {name} with other ranks "
                           f"({_theirs(name)}, this layout needs {_mine(layout, rank)} on rank {rank}): an "
                           f"earlier run in this process did not end cleanly; start a new process")


def release_expert_groups(ep: int) -> None:
    """At the end of a run: drop and destroy the expert groups DeepSpeed created for it (module globals that
    would otherwise keep their process groups, and gloo's threads, for the life of the process)."""
    import torch.distributed as dist
    from deepspeed.utils import groups
    name = group_name(ep)
    handles = [table.pop(name, None) for table in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP)]
    for table in (groups._EXPERT_PARALLEL_GROUP_RANKS, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        table.pop(name, None)
    for handle in handles:
        if handle is not None and dist.is_initialized():
            dist.destroy_process_group(handle)


def _theirs(name: str) -> tuple[list[int], list[int]]:
    from deepspeed.utils import groups
    return (list(groups._get_expert_parallel_group_ranks(name)),
            list(groups._get_expert_data_parallel_group_ranks(name)))


def _mine(layout, rank: int) -> tuple[list[int], list[int]]:
    return tuple(list(next(g for g in gs if rank in g)) for gs in (layout.ep_groups(), layout.expert_dp_groups()))
