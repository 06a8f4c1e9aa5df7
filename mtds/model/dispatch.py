"""Token dispatch: which rows go to which expert, and back, kept apart from the router and the experts.

:class:`LocalDispatcher` (every rank holds every expert): a stable sort of the N·k (token, slot)
assignments by expert and an ``index_select`` of the token rows; combine multiplies each expert output row
by its routing weight and ``index_add``s it into its token. Dropless: every assignment is computed (no
capacity, as transformers), unless ``--moe-expert-capacity-factor`` dropped some: their expert reads E
(:meth:`~mtds.model.router.Routing.dispatched`), they sort last and are cut off (neither sent nor combined).

:class:`AllToAllDispatcher` (expert parallelism, e ranks each holding E/e consecutive experts): the same
sort, then the rows of rank j's experts (consecutive after the sort) go to rank j by one all-to-all with
uneven splits, the per-expert counts exchanged first (an all-to-all of E integers; their host copy sizes
the exchange, one sync per block as in Megatron's alltoall dispatcher). A rank receives its experts' rows
grouped by source rank, regroups them by expert for the expert loop, and sends the outputs back by the
inverse exchange; the routing weight is applied on the token's own rank, after the return trip, so the
router's gradient never crosses ranks. Bytes per block and direction: the rows leaving this rank, (N·k -
own rows)·h·bytes, the same again on the way back, and as much again in backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtds.model.router import Routing
from mtds.tp import all_to_all
from mtds.tp.async_all_to_all import Pending, start_all_to_all


@dataclass
class Dispatched:
    """Rows grouped by expert: ``rows`` [N·k, h] sorted by expert (stable: token order within one),
    ``counts`` [E] rows per expert (a CPU list: the expert loop splits by it), ``token`` [N·k] the token
    each row came from, ``order`` [N·k] its flat (token, slot) position in the routing. With expert
    parallelism ``rows`` / ``counts`` are the rows this rank's experts received (counts per local expert)
    and ``exchange`` what the return trip needs."""
    rows: torch.Tensor
    counts: list[int]
    token: torch.Tensor
    order: torch.Tensor
    exchange: "_Exchange | None" = None


@dataclass
class _Exchange:
    sent: list[int]          # rows this rank sent to each rank of the group
    received: list[int]      # rows it received from each
    by_expert: torch.Tensor  # received rows (grouped by source) in local-expert order: rows = received[by_expert]


@dataclass
class _Plan:
    """Who sends which rows where, from the routing and the counts' exchange."""
    order: torch.Tensor
    token: torch.Tensor
    sent: list[int]
    received: list[int]
    incoming: torch.Tensor   # [e·L]: rows each source sends to each local expert
    per_expert: list[int]


@dataclass
class _InFlight:
    """A dispatch whose rows' all-to-all is still in flight (``--overlap-moe-expert-parallel-comm``)."""
    rows: torch.Tensor
    pending: Pending
    plan: _Plan


class LocalDispatcher:
    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, tokens: torch.Tensor, routing: Routing) -> Dispatched:
        k, E = routing.experts.shape[-1], self.num_experts
        flat = routing.experts.reshape(-1)
        counts = torch.bincount(flat, minlength=E + 1).tolist()[:E]   # [E]: the dropped, if any
        order = torch.argsort(flat, stable=True)[:sum(counts)]
        token = torch.div(order, k, rounding_mode="floor")
        return Dispatched(tokens.index_select(0, token), counts, token, order)

    def combine(self, outputs: torch.Tensor, routing: Routing, sent: Dispatched, num_tokens: int) -> torch.Tensor:
        """[N, h]: each token's sum over its k experts of weight x output, in the rows' dtype (transformers
        multiplies in the weight's dtype, fp32, and adds in the hidden dtype)."""
        weights = routing.weights.reshape(-1).index_select(0, sent.order)
        weighted = (outputs * weights.unsqueeze(-1)).to(outputs.dtype)
        out = outputs.new_zeros(num_tokens, outputs.shape[-1])
        return out.index_add(0, sent.token, weighted)


class AllToAllDispatcher(LocalDispatcher):
    """Expert parallelism over ``group`` (e ranks; rank j holds experts [j·E/e, (j+1)·E/e))."""

    def __init__(self, num_experts: int, group):
        super().__init__(num_experts)
        self.group = group
        # the exchanges' backward (None: ``group``): a duplicate of it under DualPipeV's cross-chunk overlap
        self.backward_group = None
        self.world = dist.get_world_size(group)
        self.local = num_experts // self.world

    def dispatch(self, tokens: torch.Tensor, routing: Routing) -> Dispatched:
        plan = self._plan(routing)
        rows = all_to_all(tokens.index_select(0, plan.token), self.group, plan.received, plan.sent,
                          self.backward_group)
        return self._regroup(rows, plan)

    def plan(self, routing: Routing) -> "_Plan":
        """Who sends which rows where: the routing sorted, the counts exchanged (waited for: their host copy
        sizes the rows' exchange)."""
        return self._plan(routing)

    def send_rows(self, tokens: torch.Tensor, plan: "_Plan", span=None) -> "_InFlight":
        """The rows' all-to-all of :meth:`dispatch`, issued and left in flight
        (``--overlap-moe-expert-parallel-comm``); :meth:`receive_rows` waits for it. The same rows, bit for bit.
        ``span``: a timeline record from the issue to the wait's return (mtds.tp.async_all_to_all)."""
        rows, pending = start_all_to_all(tokens.index_select(0, plan.token), self.group, plan.received, plan.sent,
                                         span, self.backward_group)
        return _InFlight(rows, pending, plan)

    @staticmethod
    def receive_rows(flight: "_InFlight") -> "_InFlight":
        flight.pending.wait()
        return flight

    def regroup(self, flight: "_InFlight") -> Dispatched:
        return self._regroup(flight.rows, flight.plan)

    def _plan(self, routing: Routing) -> "_Plan":
        k, e, L = routing.experts.shape[-1], self.world, self.local
        flat = routing.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts + 1)[:self.num_experts]   # [E]: the dropped, if any
        incoming = torch.empty_like(counts)     # [source j, local expert]: rows j sends to each of my experts
        dist.all_to_all_single(incoming, counts, group=self.group)
        both = torch.stack([counts, incoming]).view(2, e, L).tolist()     # one host sync for both
        sent, received = [sum(row) for row in both[0]], [sum(row) for row in both[1]]
        order = order[:sum(sent)]
        token = torch.div(order, k, rounding_mode="floor")
        per_expert = [sum(row[x] for row in both[1]) for x in range(L)]
        return _Plan(order, token, sent, received, incoming, per_expert)

    def _regroup(self, rows: torch.Tensor, plan: "_Plan") -> Dispatched:
        # received rows are grouped by source, each source's by local expert: a stable sort by local expert
        # regroups them by expert, then source, as the local sort above grouped this rank's own rows
        e, L = self.world, self.local
        local = torch.arange(L, device=rows.device).repeat(e)
        by_expert = torch.argsort(torch.repeat_interleave(local, plan.incoming, output_size=sum(plan.received)),
                                  stable=True)
        return Dispatched(rows.index_select(0, by_expert), plan.per_expert, plan.token, plan.order,
                          _Exchange(plan.sent, plan.received, by_expert))

    def combine(self, outputs: torch.Tensor, routing: Routing, sent: Dispatched, num_tokens: int) -> torch.Tensor:
        x = sent.exchange
        if sent.rows.requires_grad and not outputs.requires_grad:
            # the rows' exchange would skip its backward on this rank alone (its peers run theirs), and the group's
            # next exchanges would pair up wrongly: the experts must keep even an empty output in the rows' graph
            raise RuntimeError("the experts' output is not in the autograd graph of the rows they received "
                               f"({outputs.shape[0]} rows): expert parallelism needs it there on every rank")
        # back to source order, then home: the rows return in the order this rank sent them
        in_source_order = outputs.new_empty(outputs.shape).index_copy(0, x.by_expert, outputs)
        home = all_to_all(in_source_order, self.group, x.sent, x.received, self.backward_group)
        return super().combine(home, routing, sent, num_tokens)
