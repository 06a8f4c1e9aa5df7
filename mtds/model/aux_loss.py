"""transformers' load-balancing loss (``load_balancing_loss_func`` of Mixtral / Qwen3-MoE, 5.x), and how it
enters the training loss: ``loss = LM loss + router_aux_loss_coef * aux`` per forward (micro-batch), as
``MixtralForCausalLM`` does with ``output_router_logits=True``.

transformers pools every MoE block of the forward before multiplying: with f_e the fraction of all
(block, token, slot) assignments that went to expert e and P_e the mean over all (block, token) rows of
expert e's probability, aux = E · Σ_e f_e · P_e, where f_e = Σ_blocks counts_e / R and P_e = Σ_blocks
probsum_e / R, R = blocks x tokens. So it is not a sum of per-block terms: the counts of later blocks weigh
the probabilities of earlier ones. Each block keeps its counts and probability sums; the model combines
them after the forward. Only the probabilities carry a gradient (the counts come from top-k).

With ``--moe-z-loss-coeff C`` (Megatron-core's router z-loss, off by default) each block also keeps the sum
over its tokens of logsumexp(router logits)², and the loss adds C · Σ_blocks (that sum / the block's rows):
a per-block mean over the tokens, summed over the blocks (not averaged), as Megatron adds each layer's term.

With ``--moe-router-load-balancing-type seq_aux_loss`` (Megatron-core's ``sequence_load_balancing_loss_func``,
DeepSeek-V2's per-sequence loss) transformers' term is replaced by, per MoE block, the mean over the micro-batch's
sequences of Σ_e f_e · P_e with f_e = (the sequence's assignments to e) · E / (s · k) and P_e = the mean over its
s tokens of e's probability, summed over the blocks and weighted by ``--moe-aux-loss-coeff``.

Every position counts (transformers without an attention mask): mtds trains on packed sequences with no
padding, and a position whose label is ignored (-100) is still routed and still counts there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from mtds.model.router import Routing


@dataclass
class RouterStats:
    counts: torch.Tensor      # [E] float32: assignments per expert (no gradient)
    prob_sum: torch.Tensor    # [E] float32: sum over the tokens of each expert's probability
    rows: int                 # tokens routed
    z_sum: torch.Tensor | None = None   # sum over the tokens of logsumexp(logits)² (z-loss on), with gradient
    seq_counts: torch.Tensor | None = None     # [b, E] per sequence (seq_aux_loss on): assignments, no gradient
    seq_prob_sum: torch.Tensor | None = None   # [b, E] per sequence: the sum over its tokens of the probabilities

    @staticmethod
    def of(routing: Routing, sequences: int | None = None) -> "RouterStats":
        """``sequences``: keep the per-sequence sums too, the tokens being ``sequences`` rows of equal length."""
        E = routing.probs.shape[-1]
        counts = torch.bincount(routing.experts.reshape(-1), minlength=E).float()   # before any capacity drop
        stats = RouterStats(counts, routing.probs.sum(dim=0), routing.probs.shape[0], routing.z_sum)
        if sequences is not None:
            chosen = torch.zeros_like(routing.probs).scatter_(1, routing.experts, 1.0)   # [N, E] 0/1
            stats.seq_counts = chosen.view(sequences, -1, E).sum(dim=1)
            stats.seq_prob_sum = routing.probs.view(sequences, -1, E).sum(dim=1)
        return stats

    def z_mean(self) -> torch.Tensor | None:
        """This block's z-loss before the coefficient: the mean over its tokens of logsumexp(logits)²."""
        return None if self.z_sum is None else self.z_sum / self.rows


def load_balancing_loss(stats: Iterable[RouterStats]) -> torch.Tensor:
    """transformers' aux loss over the blocks of one forward (see the module docstring)."""
    stats = list(stats)
    rows = sum(s.rows for s in stats)
    counts = torch.stack([s.counts for s in stats]).sum(dim=0)
    prob_sum = torch.stack([s.prob_sum for s in stats]).sum(dim=0)
    return counts.numel() * torch.sum((counts / rows) * (prob_sum / rows))


def sequence_aux_loss(stats: RouterStats) -> torch.Tensor:
    """One block's Megatron-core seq_aux_loss before the coefficient (see the module docstring)."""
    counts, prob_sum = stats.seq_counts, stats.seq_prob_sum
    E, per_sequence = counts.shape[-1], counts.sum(dim=-1, keepdim=True)     # s · k each
    tokens = per_sequence / (counts.sum() / stats.rows)                     # s
    return ((counts * E / per_sequence) * (prob_sum / tokens)).sum(dim=-1).mean()


def collect_aux_loss(blocks: Iterable, coef: float, training: bool = True,
                     z_coef: float = 0.0, seq_coef: float | None = None) -> torch.Tensor | None:
    """``coef`` x the aux loss of the MoE blocks' last forward (plus ``z_coef`` x their z-losses' sum), taking
    their stats (so a later forward never sees them); None when no block kept any (a dense model) or when not
    ``training``. Under full
    recomputation (a non-reentrant checkpoint) the backward's recompute sets a block's stats again after
    they were collected: an evaluation forward, which sets none, must not read those, hence ``training``.
    ``seq_coef``: Megatron-core's seq_aux_loss with that weight in place of transformers' term."""
    stats = []
    for block in blocks:
        if block.stats is not None:
            stats.append(block.stats)
            if training:   # the step log's tokens per expert (mtds.training.expert_load), once per forward
                block.note(block.stats)
            block.stats = None
    if not stats or not training:
        return None
    if seq_coef is None:
        loss = coef * load_balancing_loss(stats)
    else:   # seq_aux_loss in place of transformers' term
        loss = seq_coef * sum(sequence_aux_loss(s) for s in stats)
    if z_coef:
        loss = loss + z_coef * sum(s.z_mean() for s in stats)
    return loss
