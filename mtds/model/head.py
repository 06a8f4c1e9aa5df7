"""Output side: final norm (global layer L+1), untied LM head (L+2), vocab-parallel loss."""
from __future__ import annotations

import torch
from torch import nn

from mtds.cp.context import ContextParallel
from mtds.model.config import ModelConfig
from mtds.tp import mark_tensor_parallel, parallel_lm_logits, vocab_parallel_cross_entropy
from mtds.tp.init_shard import build_shard
from mtds.tp.layers import tp_world_and_rank

from mtds.model import router_carry
from mtds.model.init import normal_init, seeded
from mtds.model.norms import make_norm


class FinalNorm(nn.Module):
    def __init__(self, cfg: ModelConfig, *, seed: int = 1234, tp_group=None, sequence_parallel: bool = False,
                 carry_router_stats: bool = False):
        super().__init__()
        self.carry_router_stats = carry_router_stats
        with seeded(seed, cfg.num_layers + 1):   # norms start at ones; seeded anyway for uniformity
            self.norm = make_norm(cfg, tp_group if sequence_parallel else None)

    def forward(self, hidden):
        if self.carry_router_stats:     # (hidden, counts, probs[, segment ids]): the statistics go on to the loss
            hidden, counts, probs, *_ = hidden
            return self.norm(hidden), counts, probs
        if isinstance(hidden, tuple):   # (hidden, segment ids) of packed documents: the ids end here
            hidden = hidden[0]
        return self.norm(hidden)


class LMHead(nn.Module):
    """Untied output projection, sharded over the padded vocabulary like VocabParallelEmbedding
    (padding rows are zero and masked out by the loss / gather)."""

    def __init__(self, cfg: ModelConfig, *, tp_group=None, seed: int = 1234, sequence_parallel: bool = False):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        t, rank = tp_world_and_rank(tp_group)
        with seeded(seed, cfg.num_layers + 2):   # this rank's rows of the full table's fill: independent of t
            shard = build_shard((cfg.padded_vocab_size(t), cfg.hidden_size), 0, t, rank, normal_init(cfg.init_std),
                                valid_rows=cfg.vocab_size)
        self.weight = nn.Parameter(shard)
        mark_tensor_parallel(self.weight, 0)

    def forward(self, hidden):
        if isinstance(hidden, tuple):   # (hidden, counts, probs): the router statistics pass on to the loss
            return (self.forward(hidden[0]), *hidden[1:])
        return parallel_lm_logits(hidden, self.weight, self.tp_group, self.sequence_parallel)


class LMLoss:
    """Mean token cross entropy over vocab-sharded logits. labels[b, i] is the target of position i
    (already shifted by the data pipeline); -100 is ignored. Padded vocab columns never win.

    With context parallelism (``context``) the labels are the whole sequence's and the logits this rank's
    s/c tokens: the loss is this rank's token sum times c / (tokens with a target in the whole sequence),
    so that the mean over the c ranks -- taken with the data-parallel mean, over d·c -- is the mean over
    every token; with --eod-mask-loss the ranks hold different numbers of them, which a mean of per-rank
    means would weigh wrongly.

    On an MoE model's pipeline the logits arrive with the router statistics of every block (counts, probs):
    the load-balancing term is added here (:mod:`mtds.model.router_carry`).

    ``cross_entropy_impl``: None, the float32 cross entropy; "native", the fused one (train.py's
    --cross-entropy-loss-fusion, :mod:`mtds.tp.fused_cross_entropy`)."""

    def __init__(self, cfg: ModelConfig, tp_group=None, context: ContextParallel | None = None,
                 cross_entropy_impl: str | None = None):
        self.vocab_size, self.tp_group, self.context = cfg.vocab_size, tp_group, context
        self.aux_loss_coef, self.z_loss_coef = cfg.router_aux_loss_coef, cfg.moe_z_loss_coeff
        self.cross_entropy_impl = cross_entropy_impl

    def __call__(self, logits_shard, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(logits_shard, tuple):
            logits_shard, counts, probs = logits_shard
            return self(logits_shard, labels) + router_carry.aux_loss(counts, probs, self.aux_loss_coef,
                                                                         self.z_loss_coef)
        # The head's fresh output, read by nothing after the loss (GPTModel, the pipeline's last stage):
        # the loss works in its buffer.
        if self.context is None:
            return vocab_parallel_cross_entropy(logits_shard, labels, self.tp_group, vocab_size=self.vocab_size,
                                                reuse_logits=True, impl=self.cross_entropy_impl)
        ctx = self.context
        labels = ctx.split(labels)
        total = vocab_parallel_cross_entropy(logits_shard, labels, self.tp_group, vocab_size=self.vocab_size,
                                             reduction="sum", reuse_logits=True, impl=self.cross_entropy_impl)
        count = ctx.token_count(labels).clamp(min=1).to(total.dtype)
        return (total * ctx.size / count).reshape(())
