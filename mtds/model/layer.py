"""One transformer block (pre-norm), optionally with NeoX's parallel residual."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from mtds.cp.context import ContextParallel
from mtds.model.config import ModelConfig

from mtds.model.attention import SelfAttention
from mtds.model.latent_attention import MultiLatentAttention
from mtds.model.documents import DocumentMasking
from mtds.model.init import seeded
from mtds.model.mlp import MLP
from mtds.model import router_carry
from mtds.model.moe import MoEBlock
from mtds.model.norms import make_norm
from mtds.observe.ranges import profiler_range


class TransformerLayer(nn.Module):
    """layer_number is the *global* layer index (1..L): it seeds the init, so a layer's weights
    are the same whichever pipeline stage builds it. ``recompute_attention``: selective
    recomputation of the attention core (see :mod:`mtds.model.attention`). ``carry_router_stats``: the
    activation is (hidden, counts, probs) and an MoE block adds its router statistics to them (a pipeline of
    an MoE model, :mod:`mtds.model.router_carry`)."""

    def __init__(self, cfg: ModelConfig, layer_number: int, *, tp_group=None, seed: int = 1234, rng_tracker=None,
                 sequence_parallel: bool = False, recompute_attention: bool = False,
                 documents: DocumentMasking | None = None, context: ContextParallel | None = None,
                 ep_group=None, carry_router_stats: bool = False):
        super().__init__()
        self.carry_router_stats = carry_router_stats
        self.replay_flag = rng_tracker       # its ``replaying``: a recomputation must not count tokens again
        if not 1 <= layer_number <= cfg.num_layers:
            raise ValueError(f"layer_number {layer_number} outside 1..{cfg.num_layers} (global index)")
        self.layer_number = layer_number
        self.parallel_residual = cfg.parallel_residual
        sp_group = tp_group if sequence_parallel else None
        with seeded(seed, layer_number):
            self.input_norm = make_norm(cfg, sp_group)
            where = {} if cfg.multi_latent_attention else {"layer_number": layer_number}   # its window
            attention = MultiLatentAttention if cfg.multi_latent_attention else SelfAttention
            self.attention = attention(cfg, tp_group=tp_group, rng_tracker=rng_tracker,
                                   sequence_parallel=sequence_parallel, recompute_core=recompute_attention,
                                   documents=documents, context=context, **where)
            self.post_attention_norm = make_norm(cfg, sp_group)
            if cfg.is_moe_layer(layer_number):     # ep_group: the experts split over expert-parallel ranks
                self.mlp = MoEBlock(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel, ep_group=ep_group,
                                    cp_group=None if context is None else context.group)
            else:
                self.mlp = MLP(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel)
        # Residual-stream dropout: without sequence parallelism it acts on replicated activations
        # (after the row-parallel all-reduce), and the default generator, seeded alike on all TP
        # ranks, drops the same elements everywhere. With it, each rank holds a different sequence
        # slice and draws from its own TP stream (Megatron does the same).
        self.attention_dropout = nn.Dropout(cfg.hidden_dropout)
        self.mlp_dropout = nn.Dropout(cfg.hidden_dropout)
        self.rng_tracker = rng_tracker if sequence_parallel and cfg.hidden_dropout > 0 else None
        # keys this layer's dropout streams per forward (mtds.tp.random); nothing to key without dropout
        dropout = cfg.hidden_dropout > 0 or cfg.attention_dropout > 0
        self.streams = rng_tracker if dropout else None

    def _dropout(self, x: torch.Tensor, module: nn.Dropout, masks, i: int) -> torch.Tensor:
        """Residual-stream dropout: by a mask drawn before the forward (keyed, replicated), else by
        ``module`` in the sharded stream (sequence parallelism) or the default generator."""
        if masks is not None:
            return x * masks[i]
        with self.rng_tracker.sharded_dropout() if self.rng_tracker is not None else contextlib.nullcontext():
            return module(x)

    def forward(self, hidden):
        """``hidden``: [b, s, h], or (hidden, segment ids) with packed documents -- passed on as
        given, so the ids reach every block and pipeline stage (:mod:`mtds.model.documents`); carrying the
        router statistics, (hidden, counts, probs) and the segment ids last."""
        with profiler_range("mtds.layer"):   # a torch.profiler range (benchmarks/profile_step.py)
            return self._forward_keyed(hidden)

    def _forward_keyed(self, hidden):
        if self.carry_router_stats:     # (hidden, counts, probs[, segment ids])
            hidden, counts, probs, *segments = hidden
            if self.attention.documents is not None and not segments:
                raise RuntimeError(f"layer {self.layer_number}: the packed-document ids did not arrive with its "
                                   f"input")
            out = self._forward_streams(hidden, segments[0] if segments else None)
            block = self.mlp if isinstance(self.mlp, MoEBlock) else None
            if block is not None and block.stats is not None:
                counts, probs = router_carry.add(counts, probs, block.stats)
                if not getattr(self.replay_flag, "replaying", False):   # the step log's tokens per expert
                    block.note(block.stats)
                block.stats = None
            return (out, counts, probs, *segments)
        segments = None
        if isinstance(hidden, tuple):
            hidden, segments = hidden
        elif self.attention.documents is not None:
            # e.g. a pipeline engine that sends only the first tensor of a tuple: say so
            raise RuntimeError(f"layer {self.layer_number}: the packed-document ids did not arrive with its input")
        out = self._forward_streams(hidden, segments)
        return out if segments is None else (out, segments)

    def _forward_streams(self, hidden, segments):
        if self.streams is None:
            return self._forward(hidden, segments)
        with self.streams.layer(self.layer_number) as keyed:
            if not keyed:       # a hand-made tracker: Megatron's streams, sharded dropout forked each time
                return self._forward(hidden, segments)
            # Keyed: the replicated masks first, then the forward in the sharded stream with no generator
            # swap inside it (mtds.tp.random), so --compile traces the layer in one graph.
            p = self.mlp_dropout.p
            replicated = self.training and p > 0 and self.rng_tracker is None
            masks = self.streams.replicated_masks(hidden, p, 2, self.attention.context) if replicated else None
            with self.streams.sharded():
                return self._forward(hidden, segments, masks)

    def _forward(self, hidden: torch.Tensor, segments: torch.Tensor | None, masks=None) -> torch.Tensor:
        attn = self.attention(self.input_norm(hidden), segments)
        attn = self._dropout(attn, self.attention_dropout, masks, 0)
        if self.parallel_residual:   # NeoX: both branches read the block input
            mlp = self.mlp(self.post_attention_norm(hidden))
            return hidden + attn + self._dropout(mlp, self.mlp_dropout, masks, 1)
        hidden = hidden + attn
        mlp = self.mlp(self.post_attention_norm(hidden))
        return hidden + self._dropout(mlp, self.mlp_dropout, masks, 1)
