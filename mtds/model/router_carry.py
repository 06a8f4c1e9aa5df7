"""The load-balancing loss across pipeline stages: its statistics travel with the activations.

transformers' aux loss pools the router statistics of every MoE block of the forward (mtds.model.aux_loss):
aux = E · Σ_e (C_e / R) · (P_e / R) with C_e the assignments to expert e, P_e the sum of its probabilities
and R the rows routed, each summed over all blocks. On a pipeline the blocks sit on several stages, so from
the embedding on the activation is the tuple (hidden, counts, probs): ``counts`` int64 [E + 1] (C, then R;
no gradient, so DeepSpeed's pipeline sends it without one) and ``probs`` float32 [E] (P, with its
gradient); DeepSpeed's 1F1B and DualPipeV engines send the tuple, mtds's own engine (interleaved, zb-h1) sends
the two beside the activation (:func:`beside`, mtds.pipe.p2p). With packed documents the segment ids follow,
last: (hidden, counts, probs, ids) (mtds.model.documents.beside). Each MoE block adds its statistics; the last
stage's loss adds coef · aux. ``probs`` has one more element, [E]: the sum over the blocks of each
block's router z-loss (its mean over tokens of logsumexp(logits)², 0 without ``--moe-z-loss-coeff``), whose
gradient (the coefficient) reaches every block's router the same way. The backward then
carries d aux / d P = coef · E · C / R² from the last stage to every block's router through the stages'
gradient sends, exactly as one process would (the same sums, in block order).

In evaluation the blocks add nothing (R = 0) and the term is exactly 0 (R is clamped to 1), so the loss is
the LM loss, as transformers' evaluation. Sizes per micro-batch and stage boundary: 8(E + 1) + 4(E + 1) bytes.
"""
from __future__ import annotations

import torch

from mtds.model.aux_loss import RouterStats


def beside(num_experts: int) -> tuple:
    """What travels beside the boundary activation between stages, for an engine that sends tensor by tensor
    (mtds.pipe.p2p): (shape, dtype, has a gradient) of ``counts`` and of ``probs``, in the tuple's order.
    Sent in their own dtypes: a bf16 or fp16 wire would round P (and its gradient) and, past 256, C."""
    return (((num_experts + 1,), torch.int64, False), ((num_experts + 1,), torch.float32, True))


def start(num_experts: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Nothing routed yet. ``probs`` is a leaf that requires grad: DeepSpeed's pipeline runs backward on every
    floating-point output of a stage, which a stage with no MoE block would otherwise leave without one."""
    return (torch.zeros(num_experts + 1, dtype=torch.int64, device=device),
            torch.zeros(num_experts + 1, dtype=torch.float32, device=device, requires_grad=True))


def add(counts: torch.Tensor, probs: torch.Tensor, stats: RouterStats) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.tensor([stats.rows], dtype=torch.int64, device=counts.device)
    z = stats.z_mean()
    z = probs.new_zeros(1) if z is None else z.reshape(1)
    return counts + torch.cat([stats.counts.to(torch.int64), rows]), probs + torch.cat([stats.prob_sum, z])


def aux_loss(counts: torch.Tensor, probs: torch.Tensor, coef: float, z_coef: float = 0.0) -> torch.Tensor:
    """coef · transformers' load-balancing loss of the carried statistics (0 when nothing was routed), plus
    z_coef · the carried z-losses' sum."""
    E = probs.shape[0] - 1
    rows = counts[E].clamp(min=1).to(probs.dtype)
    aux = coef * (E * torch.sum((counts[:E].to(probs.dtype) / rows) * (probs[:E] / rows)))
    return aux + z_coef * probs[E] if z_coef else aux
