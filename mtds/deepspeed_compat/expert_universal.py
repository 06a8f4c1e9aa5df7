"""DeepSpeed's side of resharding mixture-of-experts checkpoints (docs/moe.md, "Resharding at E > 1").

Reading: a ZeRO-1/2 partition file (``zero_pp_rank_D_mp_rank_TT_optim_states.pt``) holds, per optimizer param
group, the rank's flat fp32 partition and Adam moments and, per parameter name, where its fragment lies in them
(``param_slice_mappings``, what DeepSpeed's own ds_to_universal reads). With DeepSpeed's MoE param groups the
expert group (``moe`` True) is partitioned over the expert-data-parallel group, the dense one over d.

Writing: DeepSpeed 0.19.8's universal load of ZeRO-1/2 (``load_hp_checkpoint_state``) slices a tensor marked
``is_expert_param`` with ``ep_num_experts`` E on dim 0 for the rank's EP rank in the largest expert group
(``_get_universal_checkpoint_ep_info``): [E, ...] -> this rank's [E/e, ...], before its TP slicing. So mtds writes
each stacked expert tensor whole, marked, and DeepSpeed's loader gives every rank its own experts, moments
included. Unmarked it would copy the first E/e experts' numbers into every EP rank (a flat narrow): the mark is
what keeps the experts apart.

Checked against DeepSpeed 0.19.8 (capabilities: "load expert tensors of a universal checkpoint per EP rank").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

STATES = ("fp32", "exp_avg", "exp_avg_sq")      # the universal layout's file names, as ds_to_universal's


@dataclass
class GroupPartition:
    """One optimizer param group of one rank's partition file."""
    moe: bool                                    # DeepSpeed's expert group: partitioned over expert-DP ranks
    fragments: dict[str, tuple[int, int]]        # parameter name -> (start, numel) in the flat tensors
    flat: dict[str, torch.Tensor]                # STATES -> this rank's flat partition
    step: torch.Tensor | None


def partition_groups(sd: dict) -> list[GroupPartition]:
    """The param groups of a loaded ZeRO-1/2 partition file."""
    from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT, PARAM_GROUPS,
                                                PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)
    osd = sd[OPTIMIZER_STATE_DICT]
    base = osd[BASE_OPTIMIZER_STATE]
    out = []
    for i, (group, mapping) in enumerate(zip(base[PARAM_GROUPS], osd[PARAM_SLICE_MAPPINGS])):
        state = base["state"][i]
        out.append(GroupPartition(moe=bool(group.get("moe")),
                                  fragments={n: (int(a.start), int(a.numel)) for n, a in mapping.items()},
                                  flat={"fp32": osd[SINGLE_PARTITION_OF_FP32_GROUPS][i], "exp_avg": state["exp_avg"],
                                        "exp_avg_sq": state["exp_avg_sq"]},
                                  step=state.get("step")))
    return out


def optimizer_globals(sd: dict) -> dict:
    """``zero/optimizer_state.pt``: what ds_to_universal keeps of partition file 0 (loss scaler, clipping,
    version, the groups' hyperparameters), the groups being [dense, experts] whatever the saving E was: the
    universal load copies group i's hyperparameters (lr: the resumed step's) into the engine's group i, and an
    engine at E > 1 has both (at E = 1 the dense one alone takes its). DeepSpeed's ``name`` / ``moe`` stay the
    engine's own (a group named for the saving E would make the engine look up another E's process groups)."""
    from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT, PARAM_GROUPS,
                                                PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)
    osd = sd[OPTIMIZER_STATE_DICT]
    out = {k: v for k, v in osd.items() if k not in (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS,
                                                      SINGLE_PARTITION_OF_FP32_GROUPS)}
    out[PARAM_GROUPS] = universal_param_groups(osd[BASE_OPTIMIZER_STATE][PARAM_GROUPS])
    return out


def universal_param_groups(groups: list[dict]) -> list[dict]:
    """A saved optimizer's param groups as the universal folder keeps them: [dense, experts] whatever the saving
    E was (at E = 1 the dense one stands for both), without the parameters and DeepSpeed's ``name`` / ``moe``."""
    groups = [{k: v for k, v in g.items() if k not in ("params", "name", "moe")} for g in groups]
    return groups + [dict(groups[0])] * (2 - len(groups))


def tensor_file(tensor: torch.Tensor, num_experts: int | None, split_keys: dict) -> dict:
    """A universal ``<state>.pt``: the whole tensor with ``split_keys`` (how the loader cuts it over TP, after the
    EP slicing); a stacked expert tensor marked for DeepSpeed's EP slicing."""
    from deepspeed.checkpoint.constants import EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM
    if num_experts is None:
        return {PARAM: tensor, **split_keys}
    return {PARAM: tensor, EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: num_experts, **split_keys}


def marked_experts(entry: dict) -> int | None:
    """The E a universal ``<state>.pt`` is marked with (None: not marked as experts)."""
    from deepspeed.checkpoint.constants import EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS
    return entry.get(EP_NUM_EXPERTS) if entry.get(EP_IS_EXPERT_PARAM) else None


def universal_ep_rank() -> tuple[int, int]:
    """(EP rank, E) whose experts DeepSpeed's universal load slices on this rank (E 1: none sliced)."""
    from deepspeed.runtime.base_optimizer import _get_universal_checkpoint_ep_info
    return _get_universal_checkpoint_ep_info()
