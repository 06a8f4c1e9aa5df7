"""Full (logical) tensors <-> this rank's shard, driven by the attributes the tp layers put on params.

Used by the HF loader/exporter and by tests that compare models across tensor-parallel sizes.
Full tensors are *unpadded*: vocab padding (zero rows) is added on load and dropped on gather.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from mtds.model.config import ModelConfig
from mtds.tp import shard_rows, unshard_rows
from mtds.tp.layers import tp_world_and_rank

# Parameters whose dim 0 is the (padded) vocabulary, by their name inside a global layer's module.
VOCAB_PARAMS = ("word_embeddings.weight", "weight")


def shard_of(full: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    """This rank's piece of ``full`` for ``param`` (zero-padding the vocab dim when needed; only this rank's
    experts of an expert-parallel tensor, ``expert_rows``)."""
    rows = getattr(param, "expert_rows", None)
    if rows is not None:
        full = full[rows[0]:rows[1]]
    if not getattr(param, "tensor_model_parallel", False):
        return full
    t, rank = tp_world_and_rank(group)
    dim, segments = param.partition_dim, getattr(param, "partition_segments", None)
    missing = param.shape[dim] * t - full.shape[dim]
    if missing > 0 and not segments:   # padded vocabulary rows are zero
        pad_shape = list(full.shape)
        pad_shape[dim] = missing
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    return shard_rows(full, dim, t, rank, segments)


def full_of(param: torch.Tensor, group) -> torch.Tensor:
    """The full tensor behind a (possibly sharded) param; collective over ``group`` if sharded."""
    t, _ = tp_world_and_rank(group)
    data = param.detach()
    if t == 1 or not getattr(param, "tensor_model_parallel", False):
        return data.clone()
    parts = [torch.empty_like(data) for _ in range(t)]
    dist.all_gather(parts, data.contiguous(), group=group)
    return unshard_rows(parts, param.partition_dim, getattr(param, "partition_segments", None))


def weights_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """{name: tensor} of ``module``'s parameters and persistent buffers (the state a checkpoint holds: an MoE
    router's expert bias is a buffer)."""
    return dict(module.state_dict(keep_vars=True))


def load_full_state(module: nn.Module, tensors: Mapping[str, torch.Tensor], group, *, strict: bool = True) -> None:
    """Copy full tensors {param name: tensor} into ``module``'s shards (dtype cast to the param's)."""
    params = weights_of(module)
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise KeyError(f"{type(module).__name__} has no parameter(s) {unknown}; it has {sorted(params)}")
    if strict and set(params) - set(tensors):
        raise KeyError(f"{type(module).__name__}: no value for parameter(s) {sorted(set(params) - set(tensors))}")
    with torch.no_grad():
        for name, full in tensors.items():
            piece = shard_of(full, params[name], group)
            if piece.shape != params[name].shape:
                raise ValueError(f"{type(module).__name__}.{name}: got shard {tuple(piece.shape)} from full "
                                 f"{tuple(full.shape)}, parameter is {tuple(params[name].shape)}")
            params[name].copy_(piece)


def full_state(module: nn.Module, group, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """{param name: full unpadded tensor} of one global layer's module (collective over ``group``)."""
    out = {}
    for name, param in weights_of(module).items():
        full = full_of(param, group)
        if name in VOCAB_PARAMS and full.shape[0] > cfg.vocab_size:
            full = full[:cfg.vocab_size]
        out[name] = full
    return out
