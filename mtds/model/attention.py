"""Causal self-attention, Megatron style: fused column-parallel QKV, heads split over TP ranks,
row-parallel output projection (one all-reduce in forward, one in backward; with sequence
parallelism an all-gather of the input and a reduce-scatter of the output instead).

Selective recomputation (Korthikanti et al. 2022, Section 5): the core between the two projections
(scores QK^T, softmax, attention dropout, probabilities x V) keeps 5as^2b bytes per layer for
backward but costs few FLOPs, so with ``recompute_core`` only its input (the QKV projection) is kept
and the core runs again in backward; the RNG tracker replays the dropout masks bit for bit.

Qwen3's q/k norm (``cfg.qk_norm``) normalises each head's query and key over head_dim before RoPE,
with one head_dim weight shared by all heads: every TP rank holds it whole but applies it to its own
heads only, so its gradient is a partial sum over the TP group, summed like the sequence-parallel norms'
(Megatron all-reduces its q/k layernorm gradients over TP the same way)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from mtds.cp import cp_attention
from mtds.cp.context import ContextParallel
from mtds.model.config import ModelConfig
from mtds.tp import ColumnParallelLinear, RowParallelLinear, checkpoint
from mtds.tp.layers import sharded_parameter

from mtds.model.documents import DocumentMasking, document_mask, document_positions, enabled
from mtds.model.init import normal_init, output_init
from mtds.model.norms import make_norm
from mtds.model.parallel import check_tensor_parallel
from mtds.model.rotary import apply_rotary, rotary_cos_sin
from mtds.model.sliding_window import window_bites, window_mask
from mtds.model.attention_sinks import sink_attention


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp_group=None, rng_tracker=None, sequence_parallel: bool = False,
                 recompute_core: bool = False, documents: DocumentMasking | None = None,
                 context: ContextParallel | None = None, layer_number: int | None = None):
        super().__init__()
        t, _ = check_tensor_parallel(cfg, tp_group)
        self.cfg, self.rng_tracker, self.recompute_core = cfg, rng_tracker, recompute_core
        self.context = context     # context parallelism: this rank holds s/c tokens (mtds.cp.context)
        self.documents = enabled(documents)   # packed documents: their ids come with each forward
        self.local_heads, self.local_kv_heads = cfg.num_heads // t, cfg.kv_heads // t
        d = cfg.head_dim
        # Segments [q, k, v]: each is split over ranks separately, so rank r holds query heads
        # r*H/t.. and key/value heads r*KV/t.., exactly the kv heads its query heads attend with.
        self.qkv = ColumnParallelLinear(cfg.hidden_size, cfg.qkv_size, group=tp_group, bias=cfg.qkv_bias,
                                        init_method=normal_init(cfg.init_std),
                                        output_segments=[cfg.num_heads * d, cfg.kv_heads * d, cfg.kv_heads * d],
                                        sequence_parallel=sequence_parallel)
        self.out_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, group=tp_group,
                                          bias=cfg.has_out_proj_bias, input_is_parallel=True,
                                          init_method=output_init(cfg), sequence_parallel=sequence_parallel)
        if cfg.qk_norm:   # after the projections: their init draws are the same with or without it
            heads_group = tp_group if t > 1 else None
            self.q_norm = make_norm(cfg, heads_group, size=d)
            self.k_norm = make_norm(cfg, heads_group, size=d)
        # GPT-OSS: alternating windows (cfg.attention_window) and a learned sink logit per head, split with the
        # heads over TP; drawn last, so the projections' init is the same with or without them
        self.window = cfg.sliding_window if layer_number is None else cfg.attention_window(layer_number)
        self.sinks = None
        if cfg.attention_sinks:
            if context is not None:     # refused before here (mtds.rules.context: MoE models under --cp)
                raise ValueError("attention sinks with context parallelism are not built")
            self.sinks = sharded_parameter((cfg.num_heads,), 0, tp_group, normal_init(cfg.init_std), None, None,
                                           None)
        self._rotary_cache: dict = {}

    def _rotary(self, seq: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``seq`` positions, computed once per (seq, device, dtype) in float32 and kept on the
        instance (not a buffer: model.half() must not round the float32 angles before the cos/sin)."""
        key = (seq, str(device), dtype)
        cached = self._rotary_cache.get(key)
        if cached is None:
            cos, sin = rotary_cos_sin(self.cfg, seq, device, dtype)
            if self.context is not None:   # ``seq`` is the whole sequence: the rows of this rank's tokens
                index = self.context.positions(seq, device)
                cos, sin = cos.index_select(0, index), sin.index_select(0, index)
            cached = self._rotary_cache[key] = cos, sin
        return cached

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv(x)
        if self.recompute_core and self.training:
            context = checkpoint(self.core_attention, self.rng_tracker, qkv, segments)
        else:
            context = self.core_attention(qkv, segments)
        return self.out_proj(context)

    def core_attention(self, qkv: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """[b, s, local qkv] -> [b, s, local heads * d]: everything between the two projections.
        ``segments`` [b, s]: document ids of packed documents (:mod:`mtds.model.documents`)."""
        b, s, _ = qkv.shape          # the whole sequence (x is a slice of it with sequence parallelism),
        # or with context parallelism this rank's s/c tokens of it
        d = self.cfg.head_dim
        q, k, v = qkv.split([self.local_heads * d, self.local_kv_heads * d, self.local_kv_heads * d], dim=-1)
        q = q.view(b, s, self.local_heads, d).transpose(1, 2)        # [b, heads, s, d]
        k = k.view(b, s, self.local_kv_heads, d).transpose(1, 2)
        v = v.view(b, s, self.local_kv_heads, d).transpose(1, 2)
        docs = self.documents
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cfg.position_embedding == "rotary":
            if docs is not None and docs.reset_position_ids:   # per-document positions: per call
                cos, sin = rotary_cos_sin(self.cfg, s, qkv.device, q.dtype, document_positions(segments))
            else:
                cos, sin = self._rotary(s * (self.context.size if self.context else 1), qkv.device, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.context is not None:   # dropout, windows and per-document positions refused (mtds.rules.context)
            ctx = self.context
            segments = segments if docs is not None and docs.reset_attention_mask else None
            out = cp_attention(ctx.comm_type, q, k, v, group=ctx.group, segments=segments)
            return out.transpose(1, 2).reshape(b, s, self.local_heads * d)
        p = self.cfg.attention_dropout if self.training else 0.0
        # Attention probabilities are sharded by head: their dropout must differ across TP ranks.
        forked = self.rng_tracker.sharded_dropout() if (p > 0 and self.rng_tracker is not None) else contextlib.nullcontext()
        # GQA: query head i reads kv head i // (heads / kv heads), HF's repeat_kv order, which is what
        # sdpa's enable_gqa does without copying K and V per query head.
        gqa = self.local_kv_heads != self.local_heads
        mask = document_mask(segments) if docs is not None and docs.reset_attention_mask else None
        if window_bites(self.window, s):   # [s, s] broadcasts over batch and heads
            window = window_mask(self.window, s, qkv.device)
            mask = window if mask is None else mask & window
        if self.sinks is not None:
            with forked:
                out = sink_attention(q, k, v, self.sinks, mask, p)
            return out.transpose(1, 2).reshape(b, s, self.local_heads * d)
        with forked:   # a block-diagonal and/or sliding-window causal mask, or plain causal attention
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None,
                                                 enable_gqa=gqa)
        return out.transpose(1, 2).reshape(b, s, self.local_heads * d)
