"""Input embedding (global layer 0): vocab-parallel token table + optional learned positions.

It also owns the tied output head: lm_logits() multiplies by the same (vocab-sharded) table, which
is what the pipeline's TiedLayerSpec calls on the last stage.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from mtds.model.config import ModelConfig
from mtds.tp import VocabParallelEmbedding, parallel_lm_logits, scatter_to_sequence_parallel_region
from mtds.tp.layers import tp_world_and_rank

from mtds.cp.context import ContextParallel
from mtds.model.documents import DocumentMasking, document_positions, enabled, segment_ids
from mtds.model import router_carry
from mtds.model.init import normal_init, seeded

EMBEDDING_LAYER = 0


class GPTEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp_group=None, seed: int = 1234, rng_tracker=None,
                 sequence_parallel: bool = False, documents: DocumentMasking | None = None,
                 context: ContextParallel | None = None, carry_router_stats: bool = False):
        super().__init__()
        self.cfg, self.tp_group, self.context = cfg, tp_group, context
        # an MoE model's pipeline: the router statistics start here (mtds.model.router_carry)
        self.carry_experts = cfg.num_experts if carry_router_stats else 0
        self.documents = enabled(documents)   # packed documents: forward returns (hidden, segment ids)
        # with sequence parallelism the output is this rank's slice of the sequence
        self.sequence_parallel = sequence_parallel and tp_world_and_rank(tp_group)[0] > 1
        self.rng_tracker = rng_tracker if self.sequence_parallel and cfg.hidden_dropout > 0 else None
        # keys this layer's dropout stream per forward (mtds.tp.random); nothing to key without dropout
        self.streams = rng_tracker if cfg.hidden_dropout > 0 else None
        with seeded(seed, EMBEDDING_LAYER):
            self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group=tp_group,
                                                          init_method=normal_init(cfg.init_std),
                                                          pad_to_multiple_of=cfg.make_vocab_size_divisible_by,
                                                          sequence_parallel=self.sequence_parallel)
            if cfg.position_embedding == "learned":
                self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
                normal_init(cfg.init_std)(self.position_embeddings.weight.data)
            else:
                self.position_embeddings = None
        self.dropout = nn.Dropout(cfg.hidden_dropout)   # replicated activations: default generator

    def forward(self, input_ids: torch.Tensor):
        """[b, s] ids -> hidden [b, s, h] (with sequence parallelism this rank's [b, s/t, h]); with
        packed documents (hidden, segment ids [b, s]) for the blocks downstream. With context parallelism
        ``input_ids`` is the whole sequence and everything from here on holds this rank's s/c tokens
        (:mod:`mtds.cp.context`), at their positions in the whole sequence."""
        docs = self.documents
        seq = input_ids.shape[1]
        segments = segment_ids(input_ids, docs.eod_token_id) if docs is not None else None   # of the whole
        index = None
        if self.context is not None:
            index = self.context.positions(seq, input_ids.device)
            input_ids = input_ids.index_select(1, index)
            segments = segments.index_select(1, index) if segments is not None else None
        hidden = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            if seq > self.cfg.max_position_embeddings:
                raise ValueError(f"sequence length {seq} exceeds max_position_embeddings "
                                 f"{self.cfg.max_position_embeddings}")
            if docs is not None and docs.reset_position_ids:
                positions, seq_dim = self.position_embeddings(document_positions(segments)), 1   # [b, s, h]
            else:
                index = torch.arange(seq, device=input_ids.device) if index is None else index
                positions, seq_dim = self.position_embeddings(index), 0
            if self.sequence_parallel:
                # this rank's positions; backward all-gathers their gradient (s h values, not the
                # whole table), so every rank updates the table with every position's gradient
                positions = scatter_to_sequence_parallel_region(positions, self.tp_group, dim=seq_dim)
            hidden = hidden + positions
        keyed = self.streams.layer(EMBEDDING_LAYER) if self.streams is not None else contextlib.nullcontext()
        if self.context is not None and self.streams is not None and self.training:
            with keyed:    # the whole sequence's mask, this rank's positions of it (as at c = 1)
                hidden = hidden * self.streams.replicated_masks(hidden, self.cfg.hidden_dropout, 1, self.context)[0]
        else:
            rng = self.rng_tracker.fork() if self.rng_tracker is not None else contextlib.nullcontext()
            with keyed, rng:   # sequence slices differ across TP ranks, so must their dropout masks
                hidden = self.dropout(hidden)
        if self.carry_experts:   # (hidden, counts, probs), then the segment ids with packed documents
            carried = (hidden, *router_carry.start(self.carry_experts, hidden.device))
            return carried if segments is None else (*carried, segments)
        return hidden if segments is None else (hidden, segments)

    def lm_logits(self, hidden):
        """Tied head: vocab-sharded logits [b, s, V_pad/t] from the embedding table (with the router
        statistics beside them when they travel with the activations)."""
        if isinstance(hidden, tuple):
            return (self.lm_logits(hidden[0]), *hidden[1:])
        return parallel_lm_logits(hidden, self.word_embeddings.weight, self.tp_group, self.sequence_parallel)
