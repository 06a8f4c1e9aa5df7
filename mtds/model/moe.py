"""One MoE block in place of a transformer block's MLP: router -> dispatch -> experts -> combine, with
transformers' semantics (Mixtral, Qwen3-MoE; docs/moe.md). Input and output [b, s, h] like :class:`MLP`.

Tensor parallelism: the router and dispatch run on the replicated hidden state (every TP rank routes
identically); the experts' input enters the TP region once (identity forward, gradient all-reduced), so the
router's own gradient path is not summed t times. During training the block keeps what transformers'
``load_balancing_loss_func`` needs of it (:mod:`mtds.model.aux_loss`) for the model to collect after the
forward.
"""
from __future__ import annotations

import torch
from torch import nn

from mtds.model.config import ModelConfig
from mtds.tp import copy_to_tensor_parallel_region

from mtds.model.aux_loss import RouterStats
from mtds.model.dispatch import LocalDispatcher
from mtds.model.experts import TensorParallelExperts
from mtds.model.router import TopKRouter


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        if sequence_parallel:   # build_model refuses it first with the user's words; this guards the library
            raise ValueError("MoE blocks with sequence parallelism are not built yet (docs/moe.md)")
        self.group = tp_group
        self.router = TopKRouter(cfg)
        self.experts = TensorParallelExperts(cfg, tp_group=tp_group)
        self.dispatcher = LocalDispatcher(cfg.num_experts)
        self.stats: RouterStats | None = None   # this forward's, until the model collects it

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        tokens = hidden.reshape(-1, shape[-1])
        routing = self.router(tokens)
        if self.training:
            self.stats = RouterStats.of(routing)
        sent = self.dispatcher.dispatch(copy_to_tensor_parallel_region(tokens, self.group), routing)
        outputs = self.experts(sent.rows, sent.counts)
        return self.dispatcher.combine(outputs, routing, sent, tokens.shape[0]).reshape(shape)
