"""A mixture-of-experts checkpoint (any t, p and E, fp32 or bf16 ZeRO-1/2; fp32 ZeRO-0 at p = 1:
:func:`write_universal_from_moe_zero0`) -> DeepSpeed's universal layout, the experts stacked whole (docs/moe.md,
"Resharding at E > 1").

On a pipeline each stage's files carry its model-parallel rank MM = stage·t + TP rank (``mp_rank_MM`` parameter
shapes, ``zero_pp_rank_D_mp_rank_MM`` partitions, at E > 1 and E = 1 alike): for each TP rank the stages'
parameters are gathered under their pipeline names (a tied embedding's from the first stage holding it), and
the rest is as at p = 1; mtds.checkpoint.universal aliases each folder under the other naming.

DeepSpeed's ds_to_universal merges each parameter's fragments over all d partition files, which at E > 1 is
wrong for the experts: their param group is partitioned over the d/E expert-data-parallel ranks, and each EP
shard's files hold other experts under the same name. Here, for each TP rank, data rank D (mtds.parallel.layout:
EP shard D mod E, position D // E in its expert-data-parallel group) contributes its fragments of each
parameter; the dense ones are joined in D order, an expert tensor per EP shard in position order, then the shards
stacked in EP order: [E/e, ...] x e -> [E, ...], global expert order. The TP pieces are then merged as every
mtds reader merges them (mtds.checkpoint.shard_spec: the experts' gate|up per segment on dim 1, down on dim 2).
Each tensor is written whole (``zero/<name>/<state>.pt``, fp32 weight and both Adam moments, ``step.pt``) with
the keys telling DeepSpeed's loader how to cut it over TP, the experts marked for its EP slicing
(mtds.deepspeed_compat.expert_universal). An E = 1 checkpoint of an MoE model is the case e = 1 (its experts in
the dense group).

Memory: the partition files are memory-mapped; one state of one parameter is materialised at a time (twice:
merged and its saved copy).
"""
from __future__ import annotations

import math
import os

import torch

from mtds.checkpoint.dsformat import expert_optim_file, load_file, mp_rank_file, zero_optim_file
from mtds.checkpoint.errors import CheckpointFormatError
from mtds.checkpoint.expert_files import STACKED
from mtds.checkpoint.expert_layout import BUILT, convertible
from mtds.checkpoint.meta import CheckpointMeta
from mtds.checkpoint.names import ds_name, parse
from mtds.checkpoint.reshard_zero0 import PARAM_NAMES_KEY, deepspeed_split_keys, link_engine_files
from mtds.checkpoint.shard_spec import split_of, unshard
from mtds.deepspeed_compat.expert_universal import (STATES, optimizer_globals, partition_groups, tensor_file,
                                                    universal_param_groups)


def check_convertible(tag_dir: str, meta: CheckpointMeta) -> None:
    if not convertible(meta):
        what = "weights only" if meta.weights_only else f"ZeRO-{meta.zero_stage} {meta.precision}"
        raise CheckpointFormatError(f"{tag_dir} was saved at tp {meta.tp}, pp {meta.pp} with {what}: {BUILT}; resume "
                                    f"it at the layout it was saved at")


def write_universal_from_moe(tag_dir: str, out_dir: str, meta: CheckpointMeta) -> None:
    """The conversion (the caller, mtds.checkpoint.universal, has run :func:`check_convertible`)."""
    if meta.zero_stage == 0:
        return write_universal_from_moe_zero0(tag_dir, out_dir, meta)
    cfg = meta.model_config
    shapes, pieces, steps, step, globals_ = [], [], set(), None, None
    for tp_rank in range(meta.tp):
        shape: dict[str, tuple] = {}
        mine: dict[str, dict[int, list]] = {}     # name -> EP shard -> [(position, {state: fragment})]
        for stage in range(meta.pp):              # a pipeline: each stage's files, under its model-parallel rank
            mp = stage * meta.tp + tp_rank
            new = {n: tuple(s) for group in load_file(mp_rank_file(tag_dir, mp))["param_shapes"]
                   for n, s in group.items() if n not in shape}      # a tied embedding: the first stage's
            shape.update(new)
            for d in range(meta.dp):
                sd = load_file(_partition_file(tag_dir, d, mp))
                if globals_ is None:
                    globals_ = optimizer_globals(sd)
                for group in partition_groups(sd):
                    shard, position = (d % meta.ep, d // meta.ep) if group.moe else (0, d)
                    if group.step is not None:      # Adam's step, a tensor as the engine keeps it
                        steps.add(float(group.step))
                        step = group.step if step is None else step
                    for name, (start, numel) in group.fragments.items():
                        if name in new:
                            mine.setdefault(name, {}).setdefault(shard, []).append(
                                (position, {s: group.flat[s].narrow(0, start, numel) for s in STATES}))
        shapes.append(shape)
        pieces.append(mine)
    if len(steps) != 1:
        raise CheckpointFormatError(f"{tag_dir}: the partition files disagree on Adam's step ({sorted(steps)})")
    zero = os.path.join(out_dir, "zero")
    for name in shapes[0]:
        layer, inner = parse(cfg, name)
        folder = os.path.join(zero, name)
        os.makedirs(folder, exist_ok=True)
        experts = inner in STACKED
        keys = deepspeed_split_keys(cfg, inner, split_of(cfg, layer, inner))
        for state in STATES:
            per_tp = [_joined(tag_dir, name, pieces[r].get(name, {}), state, shapes[r][name], meta.ep if experts else 1)
                      for r in range(meta.tp)]
            full = unshard(cfg, layer, inner, per_tp)
            del per_tp      # the pieces go before the copy: two copies of one state at most
            # a copy: a view (the vocabulary rows of a padded table) would save its whole storage
            torch.save(tensor_file(full.clone(), cfg.num_experts if experts else None, keys),
                       os.path.join(folder, f"{state}.pt"))
            del full
        torch.save(step.clone(), os.path.join(folder, "step.pt"))
    torch.save(globals_, os.path.join(zero, "optimizer_state.pt"))
    link_engine_files(tag_dir, out_dir, meta)


def _joined(tag_dir: str, name: str, shards: dict, state: str, shape: tuple, ep: int) -> torch.Tensor:
    """One TP rank's ``state`` of ``name``: each EP shard's fragments in position order, shaped as a rank holds
    it (``shape``), the shards stacked in EP order (experts: [E/e, ...] -> [E, ...])."""
    if sorted(shards) != list(range(ep)):
        raise CheckpointFormatError(f"{tag_dir}: the partition files hold {name} for expert shards {sorted(shards)}, "
                                    f"not 0..{ep - 1} (partial checkpoint?)")
    parts = []
    for j in range(ep):
        fragments = sorted(shards[j], key=lambda f: f[0])
        flat = torch.cat([f[state] for _, f in fragments])
        if flat.numel() != math.prod(shape) or len({p for p, _ in fragments}) != len(fragments):
            raise CheckpointFormatError(f"{tag_dir}: the partition files hold {flat.numel()} values of {name} "
                                        f"(shard {j}), not {math.prod(shape)} {shape} (partial checkpoint?)")
        parts.append(flat.view(shape))
    return torch.cat(parts)


def _partition_file(tag_dir: str, dp_rank: int, mp_rank: int) -> str:
    """Data rank ``dp_rank``'s partition file; DeepSpeed prefixes ``bf16_`` in bf16 runs, whether its ZeRO-1/2
    optimizer or its BF16 optimizer (bf16 ZeRO-1 with fp32 gradient accumulation) wrote it: the same keys."""
    path = zero_optim_file(tag_dir, dp_rank, mp_rank)
    bf16 = os.path.join(tag_dir, "bf16_" + os.path.basename(path))
    return bf16 if not os.path.isfile(path) and os.path.isfile(bf16) else path


def write_universal_from_moe_zero0(tag_dir: str, out_dir: str, meta: CheckpointMeta) -> None:
    """An fp32 ZeRO-0 checkpoint of an MoE model (p = 1, any t and E) -> the same universal layout: the weights as
    mtds's reader gives them (experts from DeepSpeed's per-expert files, stacked in global order), the Adam state
    from each EP shard's whole torch optimizer (``expp_rank_J_mp_rank_TT``; at E = 1 the ``mp_rank_TT`` file's),
    an expert tensor's moments stacked over the shards in EP order, a dense one's from shard 0 (every shard holds
    the same: ZeRO-0 all-reduces the dense gradients over d)."""
    from mtds.checkpoint.reader import open_checkpoint
    cfg = meta.model_config
    states = [_zero0_states(tag_dir, meta, r) for r in range(meta.tp)]       # per TP rank: name -> state
    steps = {float(s["step"]) for per in states for s in per.values()}
    if len(steps) != 1:
        raise CheckpointFormatError(f"{tag_dir}: the optimizer files disagree on Adam's step ({sorted(steps)})")
    zero = os.path.join(out_dir, "zero")
    for layer, tensors in open_checkpoint(tag_dir).layers():
        for inner, weight in tensors.items():
            name = ds_name(cfg, layer, inner, pipeline=False)
            if any(name not in per for per in states):
                raise CheckpointFormatError(f"{tag_dir}: no optimizer state for {name} (different model?)")
            folder = os.path.join(zero, name)
            os.makedirs(folder, exist_ok=True)
            experts = cfg.num_experts if inner in STACKED else None
            keys = deepspeed_split_keys(cfg, inner, split_of(cfg, layer, inner))
            torch.save(tensor_file(weight.float().clone(), experts, keys), os.path.join(folder, "fp32.pt"))
            for state in STATES[1:]:
                full = unshard(cfg, layer, inner, [per[name][state] for per in states])
                torch.save(tensor_file(full.clone(), experts, keys), os.path.join(folder, f"{state}.pt"))
            torch.save(states[0][name]["step"].clone(), os.path.join(folder, "step.pt"))
    import deepspeed
    groups = load_file(_zero0_optimizer_files(tag_dir, meta, 0)[0])["optimizer"]["param_groups"]
    torch.save({"ds_version": deepspeed.__version__, "param_groups": universal_param_groups(groups)},
               os.path.join(zero, "optimizer_state.pt"))
    link_engine_files(tag_dir, out_dir, meta)


def _zero0_optimizer_files(tag_dir: str, meta: CheckpointMeta, tp_rank: int) -> list[str]:
    """Each EP shard's optimizer file of TP rank ``tp_rank`` (DeepSpeed's MoE save at E > 1), else its model file."""
    files = [expert_optim_file(tag_dir, j, tp_rank) for j in range(meta.ep)]
    if meta.ep == 1 and not os.path.isfile(files[0]):
        return [mp_rank_file(tag_dir, tp_rank)]
    missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
    if missing:
        raise CheckpointFormatError(f"{tag_dir} is partial: {', '.join(missing)} missing")
    return files


def _zero0_states(tag_dir: str, meta: CheckpointMeta, tp_rank: int) -> dict[str, dict]:
    """{name: {"exp_avg", "exp_avg_sq", "step"}} of TP rank ``tp_rank``, the experts' moments [E, ...]. A torch
    optimizer keys its state by position over its param groups: DeepSpeed's MoE groups hold the expert tensors
    (``moe`` True), the others the rest, each in the model's order (``split_params_into_different_moe_groups_for_
    optimizer``), which the saved names (``PARAM_NAMES_KEY``, the model's order) are split into."""
    cfg = meta.model_config
    names = load_file(mp_rank_file(tag_dir, tp_rank)).get(PARAM_NAMES_KEY)
    if not names:
        raise CheckpointFormatError(f"{mp_rank_file(tag_dir, tp_rank)} lacks the parameter names mtds needs to reshard "
                                    f"a ZeRO-0 checkpoint")
    shards = []
    for path in _zero0_optimizer_files(tag_dir, meta, tp_rank):
        opt = load_file(path).get("optimizer")
        if not opt or "state" not in opt:
            raise CheckpointFormatError(f"{path} holds no optimizer state")
        queues = {True: [n for n in names if parse(cfg, n)[1] in STACKED], False: list(names)}
        if any(g.get("moe") for g in opt["param_groups"]):
            queues[False] = [n for n in names if n not in queues[True]]
        mine = {}
        for group in opt["param_groups"]:
            queue = queues[bool(group.get("moe"))]
            if len(queue) < len(group["params"]):
                raise CheckpointFormatError(f"{path}: its param groups do not match the saved parameter names")
            for i in group["params"]:
                mine[queue.pop(0)] = opt["state"].get(i, {})
        shards.append(mine)
    out = {}
    for name, first in shards[0].items():
        stacked = parse(cfg, name)[1] in STACKED and len(shards) > 1
        out[name] = {"step": first["step"], **{s: torch.cat([sh[name][s] for sh in shards]) if stacked else first[s]
                                              for s in STATES[1:]}}
    return out
