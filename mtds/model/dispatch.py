"""Token dispatch: which rows go to which expert, and back. Kept apart from the expert compute so expert
parallelism can replace it (an all-to-all of the sorted rows, counts first, to the ranks that own the
experts; the same inverse on the way back) without touching the router or the experts.

This increment is local: every rank holds every expert, so dispatch is a stable sort of the N·k
(token, slot) assignments by expert and an ``index_select`` of the token rows; combine multiplies each
expert output row by its routing weight and ``index_add``s it into its token. Dropless: every assignment
is computed (no capacity, as transformers).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mtds.model.router import Routing


@dataclass
class Dispatched:
    """Rows grouped by expert: ``rows`` [N·k, h] sorted by expert (stable: token order within one),
    ``counts`` [E] rows per expert (a CPU list: the expert loop splits by it), ``token`` [N·k] the token
    each row came from, ``order`` [N·k] its flat (token, slot) position in the routing."""
    rows: torch.Tensor
    counts: list[int]
    token: torch.Tensor
    order: torch.Tensor


class LocalDispatcher:
    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, tokens: torch.Tensor, routing: Routing) -> Dispatched:
        k = routing.experts.shape[-1]
        flat = routing.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = torch.div(order, k, rounding_mode="floor")
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        return Dispatched(tokens.index_select(0, token), counts, token, order)

    def combine(self, outputs: torch.Tensor, routing: Routing, sent: Dispatched, num_tokens: int) -> torch.Tensor:
        """[N, h]: each token's sum over its k experts of weight x output, in the rows' dtype (transformers
        multiplies in the weight's dtype, fp32, and adds in the hidden dtype)."""
        weights = routing.weights.reshape(-1).index_select(0, sent.order)
        weighted = (outputs * weights.unsqueeze(-1)).to(outputs.dtype)
        out = outputs.new_zeros(num_tokens, outputs.shape[-1])
        return out.index_add(0, sent.token, weighted)
