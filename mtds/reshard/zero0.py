"""Resharding without ZeRO, where DeepSpeed's universal checkpointing stops.

DeepSpeed cannot convert a ZeRO-0 checkpoint (its Adam state is a plain torch optimizer state_dict in
the ``mp_rank_*`` files, not ZeRO partitions) nor load a universal checkpoint into a ZeRO-0 engine.
Both directions go through the same per-parameter folder layout DeepSpeed uses
(``zero/<param name>/{fp32,exp_avg,exp_avg_sq,step}.pt``, full logical tensors, vocab padding stripped):

* ``write_universal_from_zero0``: an fp32 ZeRO-0 checkpoint -> that layout (our own converter);
* ``load_universal_into_zero0``: that layout (ours or DeepSpeed's) -> a running fp32 ZeRO-0 engine,
  each rank slicing its shards with the split table.
"""
from __future__ import annotations

import os

import torch

from mtds.config import ModelConfig
from mtds.safety.loading import safe_load

from .dsformat import ModuleStateReader, load_file, mp_rank_file
from .errors import CheckpointFormatError
from .meta import CheckpointMeta
from .names import ds_name, parse
from .reader import layer_names
from .spec import shard, split_of, unshard

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
            folder = os.path.join(zero, ds_name(cfg, layer, name, meta.pipeline))
            os.makedirs(folder, exist_ok=True)
            torch.save({"param": unshard(cfg, layer, name, [p.float() for p in pieces[name]])},
                       os.path.join(folder, "fp32.pt"))
            key = ds_name(cfg, layer, name, meta.pipeline)
            per_rank = [next(s[key] for (stage, r), s in states.items() if r == tp_rank and key in s)
                        for tp_rank in range(meta.tp)]
            for state in STATES:
                full = unshard(cfg, layer, name, [s[state] for s in per_rank])
                torch.save({"param": full}, os.path.join(folder, f"{state}.pt"))
            torch.save(per_rank[0]["step"], os.path.join(folder, "step.pt"))


def _torch_optimizer(engine) -> torch.optim.Optimizer:
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    if not isinstance(opt, torch.optim.Optimizer):
        raise CheckpointFormatError(f"cannot reshard into optimizer {type(engine.optimizer).__name__} without ZeRO")
    return opt


@torch.no_grad()
def load_universal_into_zero0(engine, universal: str, cfg: ModelConfig, tp: int, tp_rank: int) -> None:
    """Weights and Adam state of every local parameter from a universal folder, sliced for this rank."""
    opt = _torch_optimizer(engine)
    zero = os.path.join(universal, "zero")
    for name, param in engine.module.named_parameters():
        layer, inner = parse(cfg, name)
        folder = os.path.join(zero, name)
        if not os.path.isdir(folder):
            raise CheckpointFormatError(f"{universal} has no state for parameter {name!r} (different model?)")

        def piece(state: str) -> torch.Tensor:
            full = safe_load(os.path.join(folder, f"{state}.pt"))["param"]
            s = split_of(cfg, layer, inner)
            if s.vocab:
                full = full[:cfg.vocab_size]       # DeepSpeed strips padding too; be explicit
            local = shard(cfg, layer, inner, full, tp, tp_rank)
            if local.shape != param.shape:
                raise CheckpointFormatError(f"{universal}: {name} has shape {tuple(full.shape)}, which does not "
                                            f"give this rank's {tuple(param.shape)} (different model?)")
            return local.to(param.dtype)

        param.copy_(piece("fp32"))
        step = safe_load(os.path.join(folder, "step.pt"))
        opt.state[param] = {"step": torch.as_tensor(step, dtype=torch.float32).clone(),
                            **{state: piece(state).clone() for state in STATES}}
