"""The whole decoder on one pipeline stage (no pipeline): embedding -> L blocks -> norm -> head."""
from __future__ import annotations

import torch
from torch import nn

from mtds.model.config import ModelConfig
from mtds.tp import MODEL_PARALLEL_RNG, RNGTracker, gather_vocab_parallel_logits
from mtds.tp.random import TP_SEED_OFFSET

from mtds.model.documents import DocumentMasking
from mtds.model.embedding import GPTEmbedding
from mtds.model.head import FinalNorm, LMHead, LMLoss
from mtds.model.layer import TransformerLayer
from mtds.model.aux_loss import collect_aux_loss
from mtds.model.moe import MoEBlock
from mtds.model.parallel import check_tensor_parallel


class GPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp_group=None, seed: int = 1234, rng_tracker: RNGTracker | None = None,
                 documents: DocumentMasking | None = None):
        super().__init__()
        _, tp_rank = check_tensor_parallel(cfg, tp_group)
        if rng_tracker is None:   # own per-TP-rank stream for attention dropout (Megatron's seed offset)
            rng_tracker = RNGTracker("cuda" if torch.cuda.is_available() else "cpu")
            rng_tracker.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + tp_rank)
        self.cfg, self.tp_group, self.rng_tracker = cfg, tp_group, rng_tracker
        self.embedding = GPTEmbedding(cfg, tp_group=tp_group, seed=seed, rng_tracker=rng_tracker, documents=documents)
        self.layers = nn.ModuleList(TransformerLayer(cfg, i, tp_group=tp_group, seed=seed, rng_tracker=rng_tracker,
                                                     documents=documents)
                                    for i in range(1, cfg.num_layers + 1))
        self.final_norm = FinalNorm(cfg, seed=seed)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(cfg, tp_group=tp_group, seed=seed)
        self.loss_fn = LMLoss(cfg, tp_group)

    def global_layers(self) -> dict[int, nn.Module]:
        """Global layer index -> module (0 embedding, 1..L blocks, L+1 final norm, L+2 untied head)."""
        layers: dict[int, nn.Module] = {0: self.embedding}
        layers.update({i + 1: layer for i, layer in enumerate(self.layers)})
        layers[self.cfg.num_layers + 1] = self.final_norm
        if self.lm_head is not None:
            layers[self.cfg.num_layers + 2] = self.lm_head
        return layers

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-sharded logits [b, s, V_pad/t]."""
        hidden = self.embedding(input_ids)    # (hidden, segment ids) with packed documents
        for layer in self.layers:
            hidden = layer(hidden)
        hidden = self.final_norm(hidden)
        return self.embedding.lm_logits(hidden) if self.lm_head is None else self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Mean loss if labels (pre-shifted, -100 ignored) are given, else the vocab-sharded logits. In training
        an MoE model's loss includes router_aux_loss_coef x the load-balancing loss (mtds.model.aux_loss)."""
        logits = self.logits(input_ids)
        seq = self.cfg.moe_aux_loss_coeff if self.cfg.moe_router_load_balancing_type == "seq_aux_loss" else None
        aux = collect_aux_loss(moe_blocks(self), self.cfg.router_aux_loss_coef, self.training,
                               self.cfg.moe_z_loss_coeff, seq)
        if labels is None:
            return logits
        loss = self.loss_fn(logits, labels)
        return loss if aux is None else loss + aux

    def full_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Unsharded logits [b, s, V] on every TP rank (evaluation/parity only; collective)."""
        return gather_logits(self.cfg, self.logits(input_ids), self.tp_group)


def moe_blocks(module: nn.Module) -> list[MoEBlock]:
    """The MoE blocks under ``module``, found once: the module tree is final once built, and the walk over
    every module (about 100 for a tiny 8-layer model) ran in every forward."""
    found = module.__dict__.get("_mtds_moe_blocks")
    if found is None:
        found = [m for m in module.modules() if isinstance(m, MoEBlock)]
        module.__dict__["_mtds_moe_blocks"] = found
    return found


def gather_logits(cfg: ModelConfig, logits_shard: torch.Tensor, tp_group=None) -> torch.Tensor:
    return gather_vocab_parallel_logits(logits_shard, tp_group, cfg.vocab_size)
