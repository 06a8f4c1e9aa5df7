"""Multi-head latent attention (MLA; DeepSeek-V2/V3), transformers' ``DeepseekV3Attention`` step for step.

Queries: one column-parallel projection to every head's [no-RoPE | RoPE] dims, or (``q_lora_rank``) a
down-projection to the rank, an RMSNorm and a column-parallel up-projection. Keys and values: one
down-projection ``kv_a_proj_with_mqa`` to [latent (``kv_lora_rank``) | the decoupled RoPE key
(``qk_pos_emb_head_dim``), one for all heads]; the latent through an RMSNorm and the column-parallel
``kv_b_proj`` to every head's [key no-RoPE | value] dims. RoPE (``rotary_interleaved``: on (x0, x1), (x2, x3)
pairs, written out de-interleaved as transformers does: query and key alike, so their dot products are the
same) on the query's RoPE dims and the shared key; softmax scale (qk + RoPE dims)^-1/2, times the square of
YaRN's mscale(factor, ``mscale_all_dim``) when the RoPE scaling is YaRN with it. The value head dim may differ
from the query/key one; the row-parallel ``o_proj`` takes heads x value dims.

Tensor parallelism (Megatron-core's layout): the heads are split over the TP group (both up-projections and
``o_proj``); the down-projections and their norms are replicated on every TP rank and computed on the
replicated input, so their gradients are whole on every rank (the up-projections' input all-reduces its
gradient, and the shared RoPE key enters the TP region the same way: each rank's heads add their part).
With sequence parallelism each rank runs the down-projections and norms on its own slice (their weights'
gradients summed over TP like a norm's), the up-projections all-gather the latents, and the RoPE key is
all-gathered (its gradient reduce-scattered).

Context parallelism (ring or Ulysses): RoPE at this rank's positions of the whole sequence, then mtds.cp's
attention with the value head dim padded to the query/key one (or the other way), the output cut back.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from mtds.cp import cp_attention
from mtds.cp.context import ContextParallel
from mtds.model.config import ModelConfig
from mtds.tp import (ColumnParallelLinear, RowParallelLinear, checkpoint, copy_to_tensor_parallel_region,
                     gather_from_sequence_parallel_region, mark_sequence_parallel, shared_by_sequence_shards)

from mtds.model.documents import DocumentMasking, document_mask, document_positions, enabled
from mtds.model.init import normal_init, output_init
from mtds.model.norms import RMSNorm
from mtds.model.parallel import check_tensor_parallel
from mtds.model.rotary import yarn_mscale, apply_rotary, rotary_cos_sin

LATENT_NORM_EPS = 1e-6    # transformers' DeepseekV3RMSNorm default, which the latent norms keep


class ReplicatedLinear(nn.Module):
    """A bias-free linear layer whole on every TP rank; ``sequence_parallel_group``: the TP group when it runs on
    this rank's sequence slice (its gradient then summed over the group)."""

    def __init__(self, in_features: int, out_features: int, init_std: float, sequence_parallel_group=None):
        super().__init__()
        self.group = sequence_parallel_group
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        normal_init(init_std)(self.weight.data)
        if sequence_parallel_group is not None:
            mark_sequence_parallel(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, shared_by_sequence_shards(self.weight, self.group))


def softmax_scale(cfg: ModelConfig) -> float:
    scale = (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim) ** -0.5
    all_dim = cfg.rope_params.get("mscale_all_dim") if cfg.rope_scaling == "yarn" else None
    if all_dim:
        factor = cfg.rope_params.get("factor") or \
            cfg.max_position_embeddings / cfg.rope_params["original_max_position_embeddings"]
        mscale = yarn_mscale(factor, all_dim)
        scale = scale * mscale * mscale
    return scale


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (x0, x1), (x2, x3), ... pairs; the result de-interleaved ([evens' | odds' rotations])."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MultiLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp_group=None, rng_tracker=None, sequence_parallel: bool = False,
                 recompute_core: bool = False, documents: DocumentMasking | None = None,
                 context: ContextParallel | None = None):
        super().__init__()
        t, _ = check_tensor_parallel(cfg, tp_group)
        self.cfg, self.group, self.rng_tracker, self.recompute_core = cfg, tp_group, rng_tracker, recompute_core
        self.sequence_parallel = sequence_parallel and t > 1
        self.context, self.documents = context, enabled(documents)
        self.local_heads = cfg.num_heads // t
        H, nope, rope, v = cfg.num_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        sp_group = tp_group if self.sequence_parallel else None
        init = normal_init(cfg.init_std)
        # transformers' module order (its names too), so the init draws follow one order at every layout
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, H * (nope + rope), group=tp_group, bias=False,
                                               init_method=init, sequence_parallel=self.sequence_parallel)
        else:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, cfg.init_std, sp_group)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, sp_group)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, H * (nope + rope), group=tp_group, bias=False,
                                                 init_method=init, sequence_parallel=self.sequence_parallel)
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, cfg.kv_lora_rank + rope, cfg.init_std, sp_group)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, sp_group)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, H * (nope + v), group=tp_group, bias=False,
                                              init_method=init, sequence_parallel=self.sequence_parallel)
        self.o_proj = RowParallelLinear(H * v, cfg.hidden_size, group=tp_group, bias=False, input_is_parallel=True,
                                        init_method=output_init(cfg), sequence_parallel=self.sequence_parallel)
        self.scale = softmax_scale(cfg)
        self._rotary_cache: dict = {}

    def _rotary(self, seq: int, device, dtype):
        """cos/sin of the whole sequence's ``seq`` positions; under context parallelism this rank's rows."""
        key = (seq, str(device), dtype)
        if key not in self._rotary_cache:
            cos, sin = rotary_cos_sin(self.cfg, seq, device, dtype)
            if self.context is not None:
                index = self.context.positions(seq, device)
                cos, sin = cos.index_select(0, index), sin.index_select(0, index)
            self._rotary_cache[key] = cos, sin
        return self._rotary_cache[key]

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        # the shared RoPE key serves every head of every TP rank: each rank's heads add their part of its gradient
        k_rot = gather_from_sequence_parallel_region(k_rot, self.group) if self.sequence_parallel else \
            copy_to_tensor_parallel_region(k_rot, self.group)
        if self.recompute_core and self.training:
            context = checkpoint(self.core_attention, self.rng_tracker, q, kv, k_rot, segments)
        else:
            context = self.core_attention(q, kv, k_rot, segments)
        return self.o_proj(context)

    def core_attention(self, q: torch.Tensor, kv: torch.Tensor, k_rot: torch.Tensor,
                       segments: torch.Tensor | None = None) -> torch.Tensor:
        """q [b, s, local heads·(nope + rope)], kv [b, s, local heads·(nope + v)], k_rot [b, s, rope] ->
        [b, s, local heads·v]."""
        cfg, heads = self.cfg, self.local_heads
        nope, rope, v_dim = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        b, s, _ = q.shape
        q = q.view(b, s, heads, nope + rope).transpose(1, 2)
        q_nope, q_rot = q.split([nope, rope], dim=-1)
        k_nope, v = kv.view(b, s, heads, nope + v_dim).transpose(1, 2).split([nope, v_dim], dim=-1)
        k_rot = k_rot.view(b, 1, s, rope)
        docs = self.documents
        if docs is not None and docs.reset_position_ids:
            cos, sin = rotary_cos_sin(cfg, s, q.device, q.dtype, document_positions(segments))
        else:
            cos, sin = self._rotary(s * (self.context.size if self.context else 1), q.device, q.dtype)
        rotate = rotate_interleaved if cfg.rotary_interleaved else apply_rotary
        q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot, cos, sin)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(b, heads, s, rope)), dim=-1)
        if self.context is not None:   # dropout, windows and per-document positions refused (mtds.rules.context)
            return self._context_parallel(q, k, v, segments).transpose(1, 2).reshape(b, s, heads * v_dim)
        p = cfg.attention_dropout if self.training else 0.0
        forked = self.rng_tracker.sharded_dropout() if (p > 0 and self.rng_tracker is not None) \
            else contextlib.nullcontext()
        mask = document_mask(segments) if docs is not None and docs.reset_attention_mask else None
        with forked:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None,
                                                 scale=self.scale)
        return out.transpose(1, 2).reshape(b, s, heads * v_dim)

    def _context_parallel(self, q, k, v, segments):
        """Ring or Ulysses attention over the context-parallel group. Both take one head dim for queries, keys
        and values: the shorter side is zero-padded to the longer (zero value columns give zero output columns;
        zero query/key columns add nothing to the scores, whose scale is passed explicitly), and the output cut
        back to the value dims."""
        ctx, docs = self.context, self.documents
        qk, v_dim = q.shape[-1], v.shape[-1]
        if v_dim < qk:
            v = F.pad(v, (0, qk - v_dim))
        elif qk < v_dim:
            q, k = F.pad(q, (0, v_dim - qk)), F.pad(k, (0, v_dim - qk))
        segments = segments if docs is not None and docs.reset_attention_mask else None
        out = cp_attention(ctx.comm_type, q, k.contiguous(), v, group=ctx.group, segments=segments, scale=self.scale)
        return out[..., :v_dim]
