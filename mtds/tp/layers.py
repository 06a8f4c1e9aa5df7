"""Tensor-parallel layers (Megatron names): column/row parallel linear and vocab-parallel embedding.

Initialisation is layout independent: each rank's slice holds exactly the values a fill of the *full*
(unsharded) weight with its ``init_method`` would give, so the model a seed produces is the same for every
tensor-parallel size. That is what lets runs at different layouts be compared step by step. The full
weight is never built for ``normal_`` inits: ``init_shard.build_shard`` fills it chunk by chunk.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtds.parallel.vocab import padded_vocab_size

from mtds.tp.mappings import (copy_to_tensor_parallel_region, gather_from_tensor_parallel_region,
                       reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
                       scatter_to_tensor_parallel_region)
from mtds.tp.init_shard import NormalInit, build_shard
from mtds.tp.overlapped_linear import linear_all_reducing_input_grad
from mtds.tp.sequence_grads import mark_sequence_parallel, shared_by_sequence_shards
from mtds.tp.sequence_linear import SEQUENCE_DIM, linear_with_sequence_parallel_input
from mtds.tp.weight_grad_store import linear_with_deferred_weight_grad

InitMethod = Callable[[torch.Tensor], None]


def tp_world_and_rank(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


default_init = NormalInit(std=0.02)


def mark_tensor_parallel(param: torch.Tensor, partition_dim: int, segments: Sequence[int] | None = None) -> None:
    """Attributes DeepSpeed reads (grad-norm clipping, checkpoint tools) and mtds's own HF/checkpoint code."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1
    param.partition_segments = tuple(segments) if segments else None


def unshard_rows(shards: Sequence[torch.Tensor], dim: int, segments: Sequence[int] | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_rows` given every rank's slice (rank order)."""
    world = len(shards)
    if not segments:
        return torch.cat(list(shards), dim=dim)
    local = [s // world for s in segments]
    per_rank = [shard.split(local, dim=dim) for shard in shards]
    return torch.cat([per_rank[r][i] for i in range(len(segments)) for r in range(world)], dim=dim)


def sharded_parameter(shape: Sequence[int], dim: int, group, init_method: InitMethod | None,
                       segments: Sequence[int] | None, dtype, device, valid_rows: int | None = None,
                       rows: tuple[int, int] | None = None) -> nn.Parameter:
    """This TP rank's shard as a parameter (``rows``: only dim 0's rows [a, b) as well, see build_shard)."""
    world, rank = tp_world_and_rank(group)
    local = build_shard(shape, dim, world, rank, init_method or default_init, segments, valid_rows, rows=rows)
    param = nn.Parameter(local.to(dtype=dtype or torch.get_default_dtype(), device=device))
    mark_tensor_parallel(param, dim, segments)
    return param


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns: rank i computes Y_i = X A_i + b_i.

    ``output_segments`` (e.g. ``[q, k, v]`` or ``[gate, up]``) splits each segment over the ranks
    separately, so a fused projection hands every rank matching pieces of each.
    ``sequence_parallel``: the input is this rank's sequence slice; it is all-gathered along the
    sequence (gradient reduce-scattered) instead of entering the region by a copy (Korthikanti
    et al. 2022, Section 4.2.2); only the slice is kept for backward, which gathers it again.
    """

    def __init__(self, in_features: int, out_features: int, *, group=None, bias: bool = True,
                 gather_output: bool = False, init_method: InitMethod | None = None,
                 output_segments: Sequence[int] | None = None, sequence_parallel: bool = False,
                 dtype=None, device=None):
        super().__init__()
        world, _ = tp_world_and_rank(group)
        if sequence_parallel and gather_output:
            raise ValueError("sequence_parallel and gather_output cannot be combined")
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.output_segments = tuple(output_segments) if output_segments else None
        self.weight = sharded_parameter((out_features, in_features), 0, group, init_method,
                                         output_segments, dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features // world, dtype=self.weight.dtype, device=device))
            mark_tensor_parallel(self.bias, 0, output_segments)
        else:
            self.register_parameter("bias", None)
        self.weight_grad_store = None   # a WeightGradStore while a zero-bubble schedule defers W

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = linear_with_sequence_parallel_input(x, self.weight, self.bias, self.group, self.weight_grad_store)
        elif self.weight_grad_store is None and tp_world_and_rank(self.group)[0] > 1:
            y = linear_all_reducing_input_grad(x, self.weight, self.bias, self.group)
        else:
            y = linear_with_deferred_weight_grad(copy_to_tensor_parallel_region(x, self.group), self.weight,
                                                 self.bias, self.weight_grad_store)
        if not self.gather_output:
            return y
        y = gather_from_tensor_parallel_region(y, self.group)
        if self.output_segments and self.group is not None:
            # The gather yields [rank0 pieces | rank1 pieces | ...]; put segments back in order.
            y = unshard_rows(y.chunk(dist.get_world_size(self.group), dim=-1), y.dim() - 1, self.output_segments)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, local_out={self.weight.shape[0]}"


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows: rank i computes X_i A_i, the partial sums are all-reduced.

    The bias is replicated and added once, after the reduction (adding it per rank would count it t times).
    ``sequence_parallel``: the partial sums are reduce-scattered along the sequence instead of
    all-reduced, so each rank leaves with its sequence slice.
    """

    def __init__(self, in_features: int, out_features: int, *, group=None, bias: bool = True,
                 input_is_parallel: bool = True, init_method: InitMethod | None = None,
                 sequence_parallel: bool = False, dtype=None, device=None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True")
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.weight = sharded_parameter((out_features, in_features), 1, group, init_method, None, dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=self.weight.dtype, device=device))
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)
        self.weight_grad_store = None   # a WeightGradStore while a zero-bubble schedule defers W

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        if self.sequence_parallel:
            y = linear_with_deferred_weight_grad(x, self.weight, None, self.weight_grad_store)
            y = reduce_scatter_to_sequence_parallel_region(y, self.group, SEQUENCE_DIM)
            return y if self.bias is None else y + shared_by_sequence_shards(self.bias, self.group)
        y = linear_with_deferred_weight_grad(x, self.weight, None, self.weight_grad_store)
        y = reduce_from_tensor_parallel_region(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, local_in={self.weight.shape[1]}"


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary; each rank looks up only its token range.

    Padding rows (ids >= vocab_size) are zero and are masked out of the logits by
    :func:`vocab_parallel_cross_entropy` / :func:`gather_vocab_parallel_logits`.
    """

    def __init__(self, vocab_size: int, embedding_dim: int, *, group=None, init_method: InitMethod | None = None,
                 pad_to_multiple_of: int = 128, sequence_parallel: bool = False, dtype=None, device=None):
        super().__init__()
        world, rank = tp_world_and_rank(group)
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.vocab_size = vocab_size
        self.embedding_dim = embedding_dim
        self.padded_vocab_size = padded_vocab_size(vocab_size, world, pad_to_multiple_of)
        per_rank = self.padded_vocab_size // world
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank

        # Padding rows are zero and draw nothing from the generator.
        self.weight = sharded_parameter((self.padded_vocab_size, embedding_dim), 0, group, init_method,
                                         None, dtype, device, valid_rows=vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group is None or dist.get_world_size(self.group) == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:   # sum the vocab shards and keep this rank's sequence slice
            return reduce_scatter_to_sequence_parallel_region(out, self.group, SEQUENCE_DIM)
        return reduce_from_tensor_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, padded={self.padded_vocab_size}, dim={self.embedding_dim}"


def parallel_lm_logits(hidden: torch.Tensor, vocab_shard_weight: torch.Tensor, group,
                       sequence_parallel: bool = False) -> torch.Tensor:
    """Vocab-sharded logits: enter the TP region (grad all-reduce) and multiply by this rank's rows.
    With sequence parallelism ``hidden`` is a sequence slice: all-gather it (grad reduce-scatter)."""
    if sequence_parallel:
        return linear_with_sequence_parallel_input(hidden, vocab_shard_weight, None, group)
    if tp_world_and_rank(group)[0] > 1:     # the input-gradient all-reduce runs during the weight-gradient GEMM
        return linear_all_reducing_input_grad(hidden, vocab_shard_weight, None, group)
    return F.linear(hidden, vocab_shard_weight)
