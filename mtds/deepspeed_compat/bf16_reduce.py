"""DeepSpeed's BF16_Optimizer (bf16 + ZeRO-1 + fp32 gradient accumulation: the shipped bf16 configs) with
its gradients reduce-scattered: 2Ψ(d−1)/d values per rank and step (this reduce-scatter, then the bf16
parameter all-gather BF16_Optimizer already does) instead of 3Ψ(d−1)/d.

DeepSpeed 0.19.8's path: micro-batch gradients accumulate in one flat fp32 buffer per parameter group;
at the boundary the engine's ``buffered_allreduce_fallback`` (from the pipeline's ReduceGrads, or
``allreduce_gradients``) all-reduces all of it in buckets, cast to the communication dtype (bf16 unless
configured), summed and then divided by d (``allreduce_bucket``'s post-scaling), copied back; every rank
takes the norm over all of it, clips, and steps its partition of the buffer
(``fp32_groups_gradient_flat_partition``). No option reduce-scatters: ZeRO's ``reduce_scatter``,
``reduce_bucket_size`` and ``contiguous_gradients`` belong to DeepSpeedZeroOptimizer, which this
path does not use.

Here each group's fp32 buffer is reduce-scattered (``mtds.parallel.dp_reduce``, bucket by bucket of the engine's
``elements_per_buffer``) into that partition: each bucket's window cast to the communication dtype,
summed over the data-parallel ranks, divided by d in that dtype, copied into the fp32 partition -- the
values DeepSpeed's all-reduce leaves there (bit-identical at d = 2; at d > 2 the ring adds in another
order than gloo's all-reduce). The rest of the buffer is no longer summed, so the norm is taken over the
partition: each parameter's slice in it (DeepSpeed's own selection: no pipeline-replicated copies,
TP-duplicated parameters on TP rank 0 only), the squares summed over the data-parallel group, then over
the model-parallel group as DeepSpeed does (the norm differs from DeepSpeed's by the order its ~10^6 fp32
squares are summed in: 1e-5 relative measured).
Clipping scales the whole buffer as before; the step reads only the partition. On a pipeline the
reduction starts, as ZeRO-1's does (``zero1_reduce.reduce_early``), as soon as a stage's last backward
ends, for everything but the tied weights (whose fp32 gradients the tied all-reduce still changes),
and ends at ReduceGrads.

MoE param groups (since 2026-11-27): DeepSpeed partitions an expert group over its expert-data-parallel
group (``real_dp_process_group[i]``, ``_configure_moe_settings``) and its engine all-reduces the expert
buffers over that group, divided by the whole data-parallel size d (``_reduce_expert_gradients``); here
each expert buffer is reduce-scattered over that group, divided by d in the communication dtype -- the
values DeepSpeed leaves in the partition (at an expert-data-parallel size of 1 no collective: the cast,
the division, the copy, as DeepSpeed's all-reduce of one rank). The norm: the expert gradients' partition
slices summed over their expert-data-parallel group, handed to DeepSpeed's ``get_norm_with_moe_layers``
per expert group (which sums them over the model-parallel and expert-parallel groups as before).

Installed only where that is exactly DeepSpeed's state otherwise: ZeRO stage 1, d > 1, fp32
accumulation, 2-norm, post-scaled averaging without a predivide factor, no Muon or sequence-data
-parallel group. ``SCATTER = False`` keeps DeepSpeed's path (tests compare the two). Checked against
DeepSpeed 0.19.8.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mtds.deepspeed_compat.zero1_reduce import EarlyReducer

REDUCE = "BF16_Optimizer gradient reduction (engine.buffered_allreduce_fallback)"
NORM = "BF16_Optimizer.get_grads_for_norm"
EARLY_BUCKET = 500_000_000      # DeepSpeed's MEMORY_OPT_ALLREDUCE_SIZE, the pipeline's ReduceGrads bucket
SCATTER = True                  # False: DeepSpeed's all-reduce stays (read at install)


def _is_expert_group(param_group) -> bool:
    from deepspeed.moe.utils import is_moe_param_group
    return bool(is_moe_param_group(param_group))


def unsupported_reason(engine) -> str | None:
    """Why this engine keeps DeepSpeed's bf16 all-reduce (None: the reduce-scatter applies)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    opt = engine.optimizer
    if not SCATTER:
        return "switched off (bf16_reduce.SCATTER)"
    if type(opt) is not BF16_Optimizer or engine.zero_optimization_stage() != 1:
        return "not DeepSpeed's BF16_Optimizer under ZeRO-1"
    if opt.grad_acc_dtype != torch.float32 or opt.norm_type != 2 or opt._uses_muon:
        return "bf16 accumulation, another norm or Muon"
    if not engine.gradient_average or not engine.postscale_gradients() or engine.gradient_predivide_factor() != 1.0:
        return "gradient averaging off, pre-scaled or with a predivide factor"
    if engine.sequence_parallel_size != 1:
        return "a sequence-data-parallel group"
    # the dense groups over the data-parallel group; an expert group over its own (expert-data-parallel) one
    dense = tuple(dist.get_process_group_ranks(opt.dp_process_group))
    ranks = {tuple(dist.get_process_group_ranks(group)) for group, param_group in
             zip(opt.real_dp_process_group, opt.optimizer.param_groups) if not _is_expert_group(param_group)}
    if ranks != {dense} or len(dense) == 1:
        return "no data parallelism (or several data-parallel groups)"
    return None


class Bf16ReduceScatter(EarlyReducer):
    """The engine's ``buffered_allreduce_fallback`` (for the optimizer's own gradients) and the
    optimizer's norm selection, for one engine; :meth:`reduce_early` as ZeRO-1's reducer has it."""

    early_mark = "Bf16ReduceScatter.reduce_early"

    def __init__(self, engine, reduce_scatter_sum, split_by_spans, late_params):
        super().__init__(engine, reduce_scatter_sum, split_by_spans, late_params)
        self.engine = engine
        self.fallback = engine.buffered_allreduce_fallback
        self.grads_for_norm = self.opt.get_grads_for_norm
        self.group = self.opt.dp_process_group
        # group i's reduce-scatter group: the data-parallel group, or an expert group's expert-data-parallel one
        self.groups = list(self.opt.real_dp_process_group)
        # expert norms: each expert group name's expert-data-parallel group (one per name)
        self.expert_groups = {pg["name"]: group for pg, group in zip(self.opt.optimizer.param_groups, self.groups)
                              if _is_expert_group(pg)}

    def _reduce(self, i: int, bucket: int, ranges=None) -> None:
        # every group divided by the whole data-parallel size, experts too (DeepSpeed's _reduce_expert_gradients)
        self.reduce_scatter_sum(self.opt.fp32_groups_gradients_flat[i], self.opt.fp32_groups_gradient_flat_partition[i],
                                self.groups[i], bucket_elements=bucket, ranges=ranges,
                                dtype=self.engine.communication_data_type,
                                post_scale=1.0 / dist.get_world_size(self.group))

    def _reduce_early(self) -> None:
        late, opt = {id(p) for p in self.late_params()}, self.opt
        self.pending = []
        for i, (flat, partition) in enumerate(zip(opt.fp32_groups_gradients_flat, opt.fp32_groups_gradient_flat_partition)):
            d = dist.get_world_size(self.groups[i])
            spans = []
            for lp, grad in zip(opt.bf16_groups[i], opt.fp32_groups_gradients[i]):
                if id(lp) in late:
                    offset = (grad.data_ptr() - flat.data_ptr()) // flat.element_size()
                    spans.append((offset, offset + grad.numel()))
            now, later = self.split_by_spans(spans, d, partition.numel())
            self._reduce(i, EARLY_BUCKET, now)
            self.pending.append(later)

    def reduce(self, grads=None, elements_per_buffer=EARLY_BUCKET) -> None:
        if grads is not None:       # someone else's gradients: DeepSpeed's all-reduce
            return self.fallback(grads=grads, elements_per_buffer=elements_per_buffer)
        self.book.mark(REDUCE)
        pending, self.pending = self.pending, None
        for i in range(len(self.opt.fp32_groups_gradients_flat)):
            if pending is None:
                self._reduce(i, elements_per_buffer)
            elif any(pending[i]):
                self._reduce(i, elements_per_buffer, pending[i])
        return None

    def norm_tensors(self, for_clipping=False):
        """DeepSpeed's selection; for the norm, each tensor's slice in this rank's partition, summed over
        data parallelism here (one tensor holding the square root of the sum)."""
        if for_clipping:
            return self.grads_for_norm(for_clipping=True)
        self.book.mark(NORM)
        tensors, expert = self.grads_for_norm(for_clipping=False)
        # the experts' norms: the same per expert group name, over its expert-data-parallel group; DeepSpeed's
        # get_norm_with_moe_layers then sums them over the model- and expert-parallel groups as before
        return ([self._partition_norm(tensors, self.group)],
                {name: [self._partition_norm(grads, self.expert_groups[name])] for name, grads in expert.items()})

    def _partition_norm(self, tensors, group) -> torch.Tensor:
        """The 2-norm of ``tensors``' slices in this rank's partitions, summed over ``group``."""
        pieces = [piece for t in tensors for piece in self._pieces(t)]
        device = self.opt.fp32_groups_gradients_flat[0].device
        # one _foreach_norm, not a norm per tensor (on CPU the same per-tensor kernels: bit-identical)
        squares = (torch.stack(torch._foreach_norm(pieces, 2.0)).pow(2).sum() if pieces else
                   torch.zeros((), dtype=torch.float32, device=device))
        if dist.get_world_size(group) > 1:
            dist.all_reduce(squares, group=group)
        return squares.sqrt().reshape(1)

    def _pieces(self, t: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`_in_partition`, kept per gradient view (the flat buffers never move)."""
        cache = self.__dict__.setdefault("_piece_cache", {})
        key = (id(t), t.data_ptr())
        if key not in cache:
            cache[key] = (t, self._in_partition(t))     # t kept alive: its id stays its own
        return cache[key][1]

    def _in_partition(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` (a parameter's fp32 gradient, a view into a group's flat buffer) cut to this rank's
        partition of that buffer: one slice or none."""
        for flat, partition in zip(self.opt.fp32_groups_gradients_flat, self.opt.fp32_groups_gradient_flat_partition):
            base, size = flat.data_ptr(), flat.element_size()
            offset = (t.data_ptr() - base) // size
            if t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() and 0 <= offset <= flat.numel():
                start = (partition.data_ptr() - base) // size
                lo, hi = max(offset, start), min(offset + t.numel(), start + partition.numel())
                return [t.reshape(-1)[lo - offset:hi - offset]] if hi > lo else []
        raise RuntimeError("bf16 reduce-scatter: a gradient is not a view into BF16_Optimizer's flat fp32 buffer")


def install_bf16_reduce_scatter(engine, reduce_scatter_sum, split_by_spans, late_params) -> Bf16ReduceScatter | None:
    """Replace the engine's bf16 gradient all-reduce and the optimizer's norm selection (see the module
    docstring); the reducer, also kept as ``engine.mtds_zero1_reduce`` for ``zero1_reduce.reduce_early``
    (arguments: as ``zero1_reduce.install_reduce_scatter``'s). None (nothing changed) where
    :func:`unsupported_reason` says DeepSpeed's path stays."""
    if unsupported_reason(engine) is not None:
        return None
    reducer = Bf16ReduceScatter(engine, reduce_scatter_sum, split_by_spans, late_params)
    reducer.book.expect(REDUCE)
    reducer.book.expect(NORM)
    object.__setattr__(engine, "buffered_allreduce_fallback", reducer.reduce)
    reducer.opt.get_grads_for_norm = reducer.norm_tensors
    object.__setattr__(engine, "mtds_zero1_reduce", reducer)
    return reducer
