"""A mixture-of-experts checkpoint (any E, fp32 ZeRO-1/2, t = p = 1) -> DeepSpeed's universal layout, the
experts stacked whole (docs/moe.md, "Resharding at E > 1").

DeepSpeed's ds_to_universal merges each parameter's fragments over all d partition files, which at E > 1 is
wrong for the experts: their param group is partitioned over the d/E expert-data-parallel ranks, and each EP
shard's files hold other experts under the same name. Here data rank D (mtds.parallel.layout: EP shard D mod E,
position D // E in its expert-data-parallel group) contributes its fragments of each parameter; the dense ones
are joined in D order, an expert tensor per EP shard in position order, then the shards stacked in EP order:
[E/e, ...] x e -> [E, ...], global expert order. Each tensor is written whole (``zero/<name>/<state>.pt``,
fp32 weight and both Adam moments, ``step.pt``), the experts marked for DeepSpeed's universal load, which
slices every rank's own experts (mtds.deepspeed_compat.expert_universal). An E = 1 checkpoint of an MoE model
is the case e = 1 (its experts in the dense group).

Memory: the partition files are memory-mapped; one parameter's three states are materialised at a time.
"""
from __future__ import annotations

import math
import os

import torch

from mtds.checkpoint.dsformat import load_file, mp_rank_file
from mtds.checkpoint.errors import CheckpointFormatError
from mtds.checkpoint.expert_files import STACKED
from mtds.checkpoint.expert_layout import BUILT, convertible
from mtds.checkpoint.meta import CheckpointMeta
from mtds.checkpoint.reshard_zero0 import link_engine_files
from mtds.deepspeed_compat.expert_universal import (STATES, optimizer_globals, partition_groups, tensor_file,
                                                    zero_file_name)


def is_expert(name: str) -> bool:
    return any(name.endswith("." + s) for s in STACKED)


def check_convertible(tag_dir: str, meta: CheckpointMeta) -> None:
    if not convertible(meta):
        what = "weights only" if meta.weights_only else f"ZeRO-{meta.zero_stage} {meta.precision}"
        raise CheckpointFormatError(f"{tag_dir} was saved at tp {meta.tp}, pp {meta.pp} with {what}: {BUILT}; resume "
                                    f"it at the layout it was saved at")


def write_universal_from_moe(tag_dir: str, out_dir: str, meta: CheckpointMeta) -> None:
    check_convertible(tag_dir, meta)
    shapes = {n: tuple(s) for group in load_file(mp_rank_file(tag_dir, 0))["param_shapes"] for n, s in group.items()}
    pieces: dict[str, dict[int, list]] = {}     # name -> EP shard -> [(position, {state: fragment})]
    steps, step, globals_ = set(), None, None
    for d in range(meta.dp):
        sd = load_file(os.path.join(tag_dir, zero_file_name(d)))
        if globals_ is None:
            globals_ = optimizer_globals(sd)
        for group in partition_groups(sd):
            shard, position = (d % meta.ep, d // meta.ep) if group.moe else (0, d)
            if group.step is not None:      # Adam's step, a tensor as the engine keeps it
                steps.add(float(group.step))
                step = group.step if step is None else step
            for name, (start, numel) in group.fragments.items():
                pieces.setdefault(name, {}).setdefault(shard, []).append(
                    (position, {s: group.flat[s].narrow(0, start, numel) for s in STATES}))
    if len(steps) != 1:
        raise CheckpointFormatError(f"{tag_dir}: the partition files disagree on Adam's step ({sorted(steps)})")
    zero = os.path.join(out_dir, "zero")
    for name, shape in shapes.items():
        folder = os.path.join(zero, name)
        os.makedirs(folder, exist_ok=True)
        experts = is_expert(name)
        for state in STATES:
            full = _joined(tag_dir, name, pieces.get(name, {}), state, shape, meta.ep if experts else 1)
            torch.save(tensor_file(full, meta.model_config.num_experts if experts else None),
                       os.path.join(folder, f"{state}.pt"))
        torch.save(step.clone(), os.path.join(folder, "step.pt"))
    torch.save(globals_, os.path.join(zero, "optimizer_state.pt"))
    link_engine_files(tag_dir, out_dir, meta)


def _joined(tag_dir: str, name: str, shards: dict, state: str, shape: tuple, ep: int) -> torch.Tensor:
    """``name``'s whole ``state``: each EP shard's fragments in position order, shaped as a rank holds it
    (``shape``), the shards stacked in EP order (experts: [E/e, ...] -> [E, ...])."""
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
    return torch.cat(parts) if ep > 1 else parts[0].clone()
