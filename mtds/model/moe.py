"""One MoE block in place of a transformer block's MLP: router -> dispatch -> experts -> combine, with
transformers' semantics (Mixtral, Qwen3-MoE; docs/moe.md). Input and output [b, s, h] like :class:`MLP`
([b, s/t, h] with sequence parallelism).

Tensor parallelism: the router and dispatch run on the replicated hidden state (every TP rank routes
identically); the experts' input enters the TP region once (identity forward, gradient all-reduced), so the
router's own gradient path is not summed t times.

Sequence parallelism: each rank routes its own slice (the router weight's gradient is then a partial sum,
summed over TP like a norm's); the slices' tokens are all-gathered for the experts (their gradient, partial
per rank's expert shard, reduce-scattered back), the routing decisions are all-gathered alongside (their
gradient is the same on every rank: each keeps its slice's, no sum), and each rank keeps its slice of the
combined output.

Expert parallelism (``ep_group``, e ranks): the experts are split over the group and the dispatch becomes
an all-to-all (:class:`~mtds.model.dispatch.AllToAllDispatcher`); with tensor parallelism each TP rank
exchanges with the same TP rank of its EP peers (the rows are the same on every TP rank of a replica), and
the experts' TP all-reduce follows as at e = 1.

A shared expert (Qwen2-MoE, DeepSeek-V3; :mod:`mtds.model.shared_expert`), where the config has one, runs on the
block input beside the routed experts and its output is added to theirs.

Context parallelism (``cp_group``, c ranks each holding 2 of the sequence's 2c chunks): routing is per token,
so each rank routes, dispatches and combines its own tokens (with expert parallelism its all-to-all reaches
whichever ranks hold the experts, context-parallel peers or not). Only the statistics are of the whole
sequence: summed over the group after the sequence-parallel sum (:func:`_summed_over_context`).

During training the block keeps what transformers' ``load_balancing_loss_func`` needs of it
(:mod:`mtds.model.aux_loss`), summed over the sequence slices, for the model to collect after the forward,
and with ``--moe-z-loss-coeff`` its router z-loss's token sum (summed over the slices too: the mean is over
the whole sequence). With ``--moe-expert-capacity-factor`` the router drops assignments past each expert's
capacity over the tokens it routed (this rank's; its slice under sequence parallelism, as Megatron's
router sees them), and the dispatch sends them nowhere (:mod:`mtds.model.capacity`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from mtds.model.config import ModelConfig
from mtds.tp import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                     gather_from_tensor_parallel_region, mark_sequence_parallel, reduce_from_tensor_parallel_region,
                     scatter_to_sequence_parallel_region, shared_by_sequence_shards)
from mtds.tp.layers import tp_world_and_rank

from mtds.model.aux_loss import RouterStats
from mtds.model.dispatch import AllToAllDispatcher, LocalDispatcher
from mtds.model.experts import TensorParallelExperts
from mtds.model.router import Routing, TopKRouter
from mtds.model.shared_expert import SharedExpert


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False, ep_group=None,
                 cp_group=None):
        super().__init__()
        self.group, self.cp_group = tp_group, cp_group
        self.per_sequence = cfg.moe_router_load_balancing_type == "seq_aux_loss"   # seq_aux_loss's statistics
        self.sequence_parallel = sequence_parallel and tp_world_and_rank(tp_group)[0] > 1
        self.router = TopKRouter(cfg)
        if self.sequence_parallel:
            mark_sequence_parallel(self.router.weight)
            if self.router.bias is not None:
                mark_sequence_parallel(self.router.bias)
        self.experts = TensorParallelExperts(cfg, tp_group=tp_group, ep_group=ep_group)
        self.dispatcher = LocalDispatcher(cfg.num_experts) if ep_group is None else \
            AllToAllDispatcher(cfg.num_experts, ep_group)
        # built last, so a model without one draws the same init as before it existed
        self.shared_expert = None if cfg.moe_shared_expert_intermediate_size is None else \
            SharedExpert(cfg, tp_group=tp_group, sequence_parallel=self.sequence_parallel)
        self.stats: RouterStats | None = None   # this forward's, until the model collects it
        self.tokens_seen = 0      # [E] assignments collected since the step log last reset it (0: none yet)
        self.z_seen = 0.0         # sum of this block's z-losses (mean over tokens, no coefficient) since then
        self.forwards = 0         # training forwards noted since then
        # --overlap-moe-expert-parallel-comm (set on the built model): the shared expert runs while the dispatch
        # all-to-all is in flight; ``comm_timeline``, a TimelineRecorder (--timeline) that records both spans
        self.overlap_dispatch = False
        self.comm_timeline = None
        # DualPipeV's cross-chunk overlap (mtds.pipe.dualpipev_overlap): the phase holding this block, the chunk
        # of its "a2a" spans (the dispatch's and the combine's exchanges) on the timeline
        self.comm_chunk = None

    def note(self, stats: RouterStats) -> None:
        """One training forward's statistics into the step log's counters (mtds.training.expert_load)."""
        self.tokens_seen = self.tokens_seen + stats.counts.detach()
        z = stats.z_mean()
        if z is not None:
            self.z_seen, self.forwards = self.z_seen + z.detach(), self.forwards + 1

    # Eager inside a compiled layer (--compile): the dispatch reads the rows per expert on the host, so a
    # traced block would be specialised on every count list (a recompile per step), and torch 2.13's fake
    # kernel of grouped_mm refuses fp32 (compiling a Mixtral layer raised). The layer's attention, norms and
    # residuals still compile; the block costs one graph break per MoE layer.
    @torch.compiler.disable
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.overlap_dispatch and self.shared_expert is not None and not self.sequence_parallel \
                and isinstance(self.dispatcher, AllToAllDispatcher):
            return self._overlapped(hidden)
        shared = None if self.shared_expert is None else self.shared_expert(hidden)
        routed = self._forward_sequence_slices(hidden) if self.sequence_parallel else self._routed(hidden)
        return routed if shared is None else routed + shared     # transformers' order of the sum

    def _routed(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        tokens = hidden.reshape(-1, shape[-1])
        routing = self._route(tokens, shape[0])
        with self._span("a2a") or contextlib.nullcontext():
            sent = self.dispatcher.dispatch(copy_to_tensor_parallel_region(tokens, self.group), routing)
        outputs = self.experts(sent.rows, sent.counts)
        with self._span("a2a") or contextlib.nullcontext():
            combined = self.dispatcher.combine(outputs, routing, sent, tokens.shape[0])
        return combined.reshape(shape)

    def _route(self, tokens: torch.Tensor, batch: int) -> Routing:
        """The routing of ``tokens`` [N, h] (keeping this forward's statistics), capacity drops applied."""
        routing = self.router(tokens, batch=batch)
        if self.training:
            self.stats = _summed_over_context(RouterStats.of(routing, batch if self.per_sequence else None),
                                              self.cp_group)
        return routing.dispatched(self.router.weight.shape[0])

    def _overlapped(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`_routed` + the shared expert, the latter computed while the dispatch's rows are exchanged
        (issued, not waited for, then waited for before the experts read them). The same values as
        :meth:`forward`'s; the backward runs the two branches in another order."""
        shape = hidden.shape
        tokens = hidden.reshape(-1, shape[-1])
        routing = self._route(tokens, shape[0])
        plan = self.dispatcher.plan(routing)
        # the "a2a" span: from the rows' all-to-all issued to its wait returned
        flight = self.dispatcher.send_rows(copy_to_tensor_parallel_region(tokens, self.group), plan,
                                           self._span("a2a"))
        with self._span("shared") or contextlib.nullcontext():
            shared = self.shared_expert(hidden)
        self.dispatcher.receive_rows(flight)
        sent = self.dispatcher.regroup(flight)
        outputs = self.experts(sent.rows, sent.counts)
        routed = self.dispatcher.combine(outputs, routing, sent, tokens.shape[0]).reshape(shape)
        return routed + shared

    def _span(self, kind: str):
        recording = self.comm_timeline is not None and torch.is_grad_enabled()   # not evaluation's
        return self.comm_timeline.record(kind, chunk=self.comm_chunk) if recording else None

    def _forward_sequence_slices(self, hidden: torch.Tensor) -> torch.Tensor:
        b, s_local, h = hidden.shape
        group = self.group
        local = self.router(hidden.reshape(-1, h), shared_by_sequence_shards(self.router.weight, group), batch=b,
                            bias=shared_by_sequence_shards(self.router.bias, group))
        if self.training:
            self.stats = _summed_over_context(
                _summed_over_slices(RouterStats.of(local, b if self.per_sequence else None), group), self.cp_group)
        local = local.dispatched(self.router.weight.shape[0])   # each slice's capacity drops, as Megatron's
        k = local.weights.shape[-1]
        # [b, s/t, k] slices -> [b, s, k] in the gathered tokens' order; the weights' gradient is the same on
        # every rank (the output below is replicated), so its backward keeps this rank's slice (no sum)
        weights = gather_from_tensor_parallel_region(local.weights.reshape(b, s_local, k).transpose(1, 2), group)
        experts = gather_from_sequence_parallel_region(local.experts.reshape(b, s_local, k), group)
        routing = Routing(None, weights.transpose(1, 2).reshape(-1, k), experts.reshape(-1, k))
        tokens = gather_from_sequence_parallel_region(hidden, group).reshape(-1, h)
        sent = self.dispatcher.dispatch(tokens, routing)
        outputs = self.experts(sent.rows, sent.counts)
        out = self.dispatcher.combine(outputs, routing, sent, tokens.shape[0]).reshape(b, -1, h)
        return scatter_to_sequence_parallel_region(out, group)


def _summed_over_slices(stats: RouterStats, group) -> RouterStats:
    """The whole sequence's statistics on every TP rank: counts summed (no gradient), probability sums
    through the all-reduce whose backward is the identity (each rank's slice gets d aux / d total)."""
    counts = stats.counts.clone()
    dist.all_reduce(counts, group=group)
    world = tp_world_and_rank(group)[0]
    z_sum = None if stats.z_sum is None else reduce_from_tensor_parallel_region(stats.z_sum, group)
    out = RouterStats(counts, reduce_from_tensor_parallel_region(stats.prob_sum, group), stats.rows * world, z_sum)
    if stats.seq_counts is not None:    # each sequence's sums over its slices
        out.seq_counts = stats.seq_counts.clone()
        dist.all_reduce(out.seq_counts, group=group)
        out.seq_prob_sum = reduce_from_tensor_parallel_region(stats.seq_prob_sum, group)
    return out


def _summed_over_context(stats: RouterStats, group) -> RouterStats:
    """The whole sequence's statistics on every context-parallel rank (``group``; None: c = 1): counts summed
    (no gradient); probability and z sums all-reduced forward and backward. The c ranks are gradient replicas,
    averaged over d·c like the LM loss (each holds the same aux term, as each LM loss is its part times c):
    the backward's sum of their c equal upstream gradients gives each rank's tokens c·d aux / d total, and
    the mean over the c replicas is then d aux / d total for every token, as at c = 1."""
    if group is None:
        return stats
    counts = stats.counts.clone()
    dist.all_reduce(counts, group=group)
    z_sum = None if stats.z_sum is None else _SummedBothWays.apply(stats.z_sum, group)
    return RouterStats(counts, _SummedBothWays.apply(stats.prob_sum, group), stats.rows * dist.get_world_size(group),
                       z_sum)


class _SummedBothWays(torch.autograd.Function):
    """All-reduce forward and backward, each on a copy. The backward must not sum its incoming gradient in
    place (as the TP region's ``f`` does): on a pipeline that gradient is a slice of the carried statistics'
    gradient (mtds.model.router_carry), the very buffer the add hands on to the earlier blocks and, through
    the stage's send, to the earlier stages, which would then take it summed c times already (Mixtral (1,2,1)
    c = 2 with both blocks on stage 0: the first block's router gradient 9% high, the run's grad norm off
    transformers' by 7.9e-4)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
