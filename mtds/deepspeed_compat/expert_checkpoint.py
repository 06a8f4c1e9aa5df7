"""mtds's expert tensors through DeepSpeed's own MoE checkpoint path (docs/moe.md, "Checkpoints at E > 1").

Once the model holds an MoE module (mtds's ``ExpertGroups``), DeepSpeed's engine saves and loads the
checkpoint its MoE way (``_save_moe_checkpoint``, ``_load_checkpoint`` -> ``load_moe_state_dict``):

* ``mp_rank_TT_model_states.pt`` (data rank 0 of each TP rank): the module state *without* the experts
  (``_get_non_moe_state_dict``), with the engine and client state as usual;
* ``layer_0_expert_G_mp_rank_TT_model_states.pt``: global expert G's state, written by expert-data-parallel
  rank 0 of the EP shard holding G from the MoE module's ``state_dict()``, whose keys name a local expert
  (``...deepspeed_experts.<local>...``, renumbered to G on save and back on load); each rank reads the files
  of its own experts into the module state dict before ``load_state_dict``;
* optimizer state: ZeRO-0 ``expp_rank_J_mp_rank_TT_optim_states.pt`` (the whole optimizer of EP shard J,
  from its expert-data-parallel rank 0), ZeRO-1/2 each data rank's own ``zero_pp_rank_D`` partitions.

DeepSpeed's own MoE holds one module per expert; mtds's experts are slices of stacked tensors [E/e, ...].
Three adapters bridge that, none replacing DeepSpeed code: ``ExpertGroups.state_dict()`` asked alone gives
each local expert's slices under DeepSpeed's per-expert names (:func:`per_expert_state`); the engine's
``_get_non_moe_state_dict`` also drops mtds's stacked expert tensors, so each expert is saved once
(:func:`install_expert_checkpointing`); a load pre-hook on the model stacks the per-expert entries DeepSpeed
put into the state dict back into mtds's names (:func:`stack_expert_state`).

On a pipeline (p > 1) the same path runs on each stage holding MoE blocks (docs/moe.md, "Checkpoints at E > 1 on a
pipeline"): DeepSpeed's MoE save takes the stage's module from ``DeepSpeedEngine.module_state_dict`` (not the
pipeline's per-layer files) into ``mp_rank_MM`` and its experts into ``layer_0_expert_G_mp_rank_MM``, MM the grid's
model-parallel rank (stage·t + TP rank), and ``PipelineEngine.load_module_state_dict`` loads that module dict back
when the engine has MoE layers. A stage without MoE blocks (no ``ExpertGroups``; ZeRO-0 only) saves and loads the
pipeline's per-layer files as a dense one. Nothing of mtds's differs from p = 1.

Checked against DeepSpeed 0.19.8 (capabilities: "checkpoint mtds's experts through DeepSpeed's MoE path",
"checkpoint an expert-parallel pipeline stage through DeepSpeed's MoE path").
"""
from __future__ import annotations

import torch

# DeepSpeed's infix of one expert's keys (engine.py: moe_str_prefix, without its dots), then the local id
EXPERT_KEY = "deepspeed_moe.experts.deepspeed_experts"
EXPERT_GROUPS = "deepspeed_expert_groups"      # the ExpertGroups module's name in the model (engine_setup adds it)


def expert_key(local: int, name: str) -> str:
    return f"{EXPERT_KEY}.{local}.{name}"


def per_expert_state(experts: dict[str, torch.Tensor], num_local: int) -> dict[str, torch.Tensor]:
    """{"...deepspeed_experts.<j>.<param name>": local expert j's slice} of the stacked ``experts``
    ({name in the model: [num_local, ...] tensor}); DeepSpeed clones each slice before writing it."""
    return {expert_key(j, name): p.detach()[j] for j in range(num_local) for name, p in experts.items()}


def stack_expert_state(state_dict: dict, groups_prefix: str, names, num_local: int, prefix: str = "") -> None:
    """In place: the per-expert entries ``groups_prefix`` + :func:`expert_key` (as DeepSpeed's load put them)
    -> one stacked tensor per name (``prefix`` + name); without them (a load that is not DeepSpeed's MoE
    load) nothing."""
    for name in names:
        keys = [groups_prefix + expert_key(j, name) for j in range(num_local)]
        if all(k in state_dict for k in keys):
            state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in keys])


def install_expert_checkpointing(engine, groups_module: str) -> None:
    """Where the engine's model holds the ``ExpertGroups`` module named ``groups_module`` (a stage with MoE
    blocks): the model file leaves out mtds's stacked experts (DeepSpeed's own hook for that drops only keys
    under an MoE module's prefix, and mtds's experts live in the blocks), and a pre-hook on the model stacks
    what DeepSpeed loaded per expert."""
    model = engine.module
    groups = getattr(model, groups_module, None)
    if groups is None:
        return
    names, num_local = tuple(groups.experts), groups.num_local_experts
    drop_deepspeeds = engine._get_non_moe_state_dict

    def non_moe_state_dict(full_state_dict):
        for name in names:
            full_state_dict.pop(name, None)
        return drop_deepspeeds(full_state_dict)

    engine._get_non_moe_state_dict = non_moe_state_dict

    def stack(module, state_dict, prefix, *_):
        stack_expert_state(state_dict, f"{prefix}{groups_module}.", names, num_local, prefix)

    model.register_load_state_dict_pre_hook(stack)
