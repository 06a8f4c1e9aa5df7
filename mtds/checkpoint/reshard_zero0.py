"""Resharding without ZeRO, where DeepSpeed's universal checkpointing stops.

DeepSpeed cannot convert a ZeRO-0 checkpoint (its Adam state is a plain torch optimizer state_dict in
the ``mp_rank_*`` files, not ZeRO partitions) nor load a universal checkpoint into a ZeRO-0 engine.
Both directions go through the same per-parameter folder layout DeepSpeed uses
(``zero/<param name>/{fp32,exp_avg,exp_avg_sq,step}.pt``, full logical tensors, vocab padding stripped):

* ``write_universal_from_zero0``: an fp32 ZeRO-0 checkpoint -> that layout (our own converter). The
  output is what DeepSpeed's ds_to_universal writes (per-parameter split keys, ``zero/optimizer_state.pt``
  with the parameter groups, the ``mp_rank_*`` engine files beside it), so DeepSpeed's own universal
  loader resumes it into ZeRO-1/2 engines at any layout;
* ``load_universal_into_zero0``: that layout (ours or DeepSpeed's) -> a running fp32 ZeRO-0 engine,
  each rank slicing its shards with the split table.

The Adam state of a ZeRO-0 checkpoint is keyed by position in the torch optimizer; it is matched to
parameters by the names saved beside it (``PARAM_NAMES_KEY``), never by order.
"""
from __future__ import annotations

import os
import shutil

import torch

from mtds.model.config import ModelConfig
from mtds.checkpoint.safe_load import safe_load

from mtds.checkpoint.dsformat import ModuleStateReader, load_file, mp_rank_file
from mtds.checkpoint.errors import CheckpointFormatError
from mtds.checkpoint.expert_files import STACKED
from mtds.checkpoint.meta import CheckpointMeta
from mtds.checkpoint.names import ds_name, parse
from mtds.checkpoint.shard_spec import Split, layer_names, shard, split_of, unshard

STATES = ("exp_avg", "exp_avg_sq")
PARAM_NAMES_KEY = "mtds_param_names"   # client_state: this rank's parameter names in optimizer order


def _optimizer_states(tag_dir: str, meta: CheckpointMeta) -> dict[tuple[int, int], dict[str, dict]]:
    """{(stage, tp rank): {ds param name: torch Adam state}} from the mp_rank files."""
    out = {}
    for stage in range(meta.pp):
        for tp_rank in range(meta.tp):
            path = mp_rank_file(tag_dir, stage * meta.tp + tp_rank if meta.pipeline else tp_rank)
            sd = load_file(path)
            names, opt = sd.get(PARAM_NAMES_KEY), sd.get("optimizer")
            if not names or not opt or "state" not in opt:
                raise CheckpointFormatError(f"{path} lacks the optimizer state or parameter names mtds needs to "
                                            f"reshard a ZeRO-0 checkpoint")
            order = [i for group in opt["param_groups"] for i in group["params"]]
            out[(stage, tp_rank)] = {names[pos]: opt["state"].get(i, {}) for pos, i in enumerate(order)}
    return out


def deepspeed_split_keys(cfg: ModelConfig, name: str, split: Split) -> dict:
    """The keys ds_to_universal writes beside a merged tensor, which tell DeepSpeed's loader how to cut
    it for a rank (deepspeed.checkpoint.constants; shard() makes the same cut). Without them it cuts
    every tensor on dim 0: the row-parallel weights come back wrong (1.1e-2 off the uninterrupted run)."""
    from deepspeed.checkpoint.constants import CAT_DIM, SUB_PARAM_SHAPE, VOCAB_TENSOR
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    if split.dim is None:
        return {}                   # replicated: the loader copies a tensor of the rank's own shape
    if split.segments:
        if name == "mlp.experts.gate_up":
            # [E, 2F, h], gate|up per expert: the loader views the tensor after slicing the rank's E/e experts
            # (mtds.deepspeed_compat.expert_universal), so the expert count is left to the view (-1)
            shape = (-1, split.segments, cfg.hidden_size)
        elif name == "mlp.experts.gate_up_bias":
            shape = (-1, split.segments)
        else:
            shape = (split.segments, *((cfg.hidden_size,) if name.endswith(".weight") else ()))
        return {SUB_PARAM_SHAPE: SubparamShape(patterns=[name], shape=shape, partition_dim=split.dim)}
    return {CAT_DIM: split.dim, **({VOCAB_TENSOR: True} if split.vocab else {})}


def write_universal_from_zero0(tag_dir: str, out_dir: str, meta: CheckpointMeta) -> None:
    if meta.precision != "fp32":
        raise CheckpointFormatError(f"{tag_dir}: resharding a ZeRO-0 {meta.precision} checkpoint is not supported "
                                    f"(fp32 only): resume it at tp={meta.tp} pp={meta.pp}")
    cfg = meta.model_config
    states = _optimizer_states(tag_dir, meta)
    weights = ModuleStateReader(tag_dir, cfg, meta.tp, meta.pipeline)
    zero = os.path.join(out_dir, "zero")
    for layer, names in layer_names(cfg).items():
        pieces = weights.pieces(layer, names)
        for name in names:
            key = ds_name(cfg, layer, name, meta.pipeline)
            folder = os.path.join(zero, key)
            os.makedirs(folder, exist_ok=True)
            extra = deepspeed_split_keys(cfg, name, split_of(cfg, layer, name))
            torch.save({"param": unshard(cfg, layer, name, [p.float() for p in pieces[name]]), **extra},
                       os.path.join(folder, "fp32.pt"))
            # Each TP rank's Adam state of this parameter, found by name (a stage holds only its layers).
            per_rank = [next(s[key] for (stage, r), s in states.items() if r == tp_rank and key in s)
                        for tp_rank in range(meta.tp)]
            for state in STATES:
                full = unshard(cfg, layer, name, [s[state] for s in per_rank])
                torch.save({"param": full, **extra}, os.path.join(folder, f"{state}.pt"))
            torch.save(per_rank[0]["step"], os.path.join(folder, "step.pt"))
    _write_engine_state(tag_dir, out_dir, meta)


def _write_engine_state(tag_dir: str, out_dir: str, meta: CheckpointMeta) -> None:
    """What DeepSpeed's universal loader reads besides the tensors: ``zero/optimizer_state.pt`` (global
    optimizer state: lr, betas, eps, weight decay of each group) and the engine files (step, LR
    schedule, client state), as ds_to_universal copies them."""
    import deepspeed
    first = load_file(mp_rank_file(tag_dir, 0))
    torch.save({"ds_version": deepspeed.__version__, "param_groups": first["optimizer"]["param_groups"]},
               os.path.join(out_dir, "zero", "optimizer_state.pt"))
    del first
    link_engine_files(tag_dir, out_dir, meta)


def link_engine_files(tag_dir: str, out_dir: str, meta: CheckpointMeta) -> None:
    """The ``mp_rank_*`` engine files beside the universal tensors (step, LR schedule, client state)."""
    for mp in range(meta.tp * meta.pp if meta.pipeline else meta.tp):
        src = mp_rank_file(tag_dir, mp)
        dst = os.path.join(out_dir, os.path.basename(src))
        try:
            os.link(src, dst)          # read-only from here on: no second copy of a big file
        except OSError:
            shutil.copyfile(src, dst)


def _torch_optimizer(engine) -> torch.optim.Optimizer:
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    if not isinstance(opt, torch.optim.Optimizer):
        raise CheckpointFormatError(f"cannot reshard into optimizer {type(engine.optimizer).__name__} without ZeRO")
    return opt


@torch.no_grad()
def load_universal_into_zero0(engine, universal: str, cfg: ModelConfig, tp: int, tp_rank: int,
                              ep: int = 1, ep_rank: int = 0) -> None:
    """Weights and Adam state of every local parameter from a universal folder, sliced for this rank: a stacked
    expert tensor [E, ...] (mixture of experts) first to this rank's EP shard's E/``ep`` experts, as DeepSpeed's
    universal load slices it for ZeRO-1/2 (mtds.deepspeed_compat.expert_universal), then over TP."""
    opt = _torch_optimizer(engine)
    on_device_step = any(group.get("fused") or group.get("capturable") for group in opt.param_groups)
    zero = os.path.join(universal, "zero")
    for name, param in engine.module.named_parameters():
        layer, inner = parse(cfg, name)
        folder = os.path.join(zero, name)
        if not os.path.isdir(folder):
            raise CheckpointFormatError(f"{universal} has no state for parameter {name!r} (different model?)")

        def piece(state: str) -> torch.Tensor:
            full = safe_load(os.path.join(folder, f"{state}.pt"))["param"]
            if inner in STACKED and ep > 1:
                if full.shape[0] != cfg.num_experts:
                    raise CheckpointFormatError(f"{universal}: {name} holds {full.shape[0]} experts, not "
                                                f"{cfg.num_experts} (different model?)")
                local = cfg.num_experts // ep
                full = full[ep_rank * local:(ep_rank + 1) * local]
            s = split_of(cfg, layer, inner)
            if s.vocab:
                full = full[:cfg.vocab_size]       # DeepSpeed strips padding too; be explicit
            local = shard(cfg, layer, inner, full, tp, tp_rank)
            if local.shape != param.shape:
                raise CheckpointFormatError(f"{universal}: {name} has shape {tuple(full.shape)}, which does not "
                                            f"give this rank's {tuple(param.shape)} (different model?)")
            return local.to(device=param.device, dtype=param.dtype)

        param.copy_(piece("fp32"))
        step = safe_load(os.path.join(folder, "step.pt"))
        # torch keeps Adam's step on the host unless the update runs on the device (fused/capturable)
        opt.state[param] = {"step": torch.as_tensor(step, dtype=torch.float32,
                                                    device=param.device if on_device_step else "cpu").clone(),
                            **{state: piece(state).clone() for state in STATES}}
