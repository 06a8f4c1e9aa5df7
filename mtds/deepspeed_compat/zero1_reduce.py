"""ZeRO-1's gradient reduction as a reduce-scatter: each data-parallel rank reduces only the partition of
the flat gradient whose optimizer state it owns (as Megatron's distributed optimizer does), so a step moves 2Ψ(d−1)/d bytes per rank (this reduce-scatter, then the
parameter all-gather DeepSpeed already does) instead of 3Ψ(d−1)/d.

Why not DeepSpeed's own options (0.19.8, ``DeepSpeedZeroOptimizer.average_tensor``): with
``reduce_scatter`` on (its default) each bucket is all-reduced and each rank keeps its partition
(``use_multi_rank_bucket_allreduce``, default on: 2Ψ(d−1)/d), or reduced to each partition's owner with
one ``dist.reduce`` per owner (off: Ψ per rank by the ring convention, d collectives per bucket); with
``reduce_scatter`` off every bucket is all-reduced. None reduce-scatters.

What replaces ``optimizer.reduce_gradients`` (the engine calls it at the accumulation boundary, from
``backward`` or a pipeline's ReduceGrads): per parameter group, the gradients are reduce-scattered
(``mtds.parallel.dp_reduce``) straight into the flat gradient partition DeepSpeed's ``step`` reads (its compact
partition buffer, with per-parameter views for the norm and the overflow check), bucket by bucket: each
bucket holds the same window of every rank's partition of the flat buffer DeepSpeed laid the parameters
out in (zero padding included), filled from ``param.grad`` and pre-divided by d as DeepSpeed does. The
transient buffer is one bucket, at most ``reduce_bucket_size`` elements (receive window included), as
DeepSpeed's own bucket is -- not a whole flat gradient copy. Then every ``param.grad`` is dropped, as
DeepSpeed's own epilogue does. A pipeline stage may reduce its final gradients earlier
(:func:`reduce_early`, right after its last backward) and the rest (tied weights) here.

Installed only where that is exactly DeepSpeed's state otherwise: stage 1, gradients in ``param.grad`` in
the communication dtype (no separate fp32 accumulation, no bucket overlap, no CPU offload), no
Muon, ZenFlow or sequence-parallel (Ulysses) group. Checked against DeepSpeed 0.19.8.
"""
from __future__ import annotations

import bisect

import torch

from mtds.deepspeed_compat.compact_partition import CompactPartition
from mtds.deepspeed_compat.ledger import ledger

NAME = "DeepSpeedZeroOptimizer.reduce_gradients"


def unsupported_reason(engine) -> str | None:
    """Why this engine's ZeRO-1 optimizer keeps DeepSpeed's reduction (None: the reduce-scatter applies)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    opt = engine.optimizer
    if engine.zero_optimization_stage() != 1 or not isinstance(opt, DeepSpeedZeroOptimizer):
        return "not DeepSpeed's ZeRO-1 optimizer"
    if opt.partition_gradients or opt.overlap_comm or opt.cpu_offload or opt.use_grad_accum_attribute:
        return "ZeRO-1 with overlap_comm, CPU offload or separate gradient accumulation"
    # MoE param groups need nothing else: DeepSpeed partitions an expert group over its expert-data-parallel
    # group (real_dp_process_group[i]), which the reduce-scatter uses, and divides expert gradients by the whole
    # data-parallel size, as the fill does for every group (average_tensor)
    if opt.zenflow or opt.sequence_parallel_size != 1 or not opt.reduce_scatter:
        return "ZenFlow, sequence-parallel groups or reduce_scatter off"
    if opt.communication_data_type != opt.dtype or opt.gradient_accumulation_dtype != opt.dtype:
        return "gradients communicated or accumulated in another dtype"
    if any(opt._is_muon_group(group) for group in opt.bit16_groups if group):
        return "Muon parameter groups"
    if not opt.gradient_average:
        return "gradient averaging off"
    return None


def _sorted_layout(flat: torch.Tensor, params) -> tuple[list[int], list[tuple[int, torch.Tensor]]]:
    """(offsets, [(offset, param)]) by offset: each parameter's element offset in DeepSpeed's flat buffer
    (its ``.data`` is a view into it)."""
    base, size = flat.data_ptr(), flat.element_size()
    spans = []
    for p in params:
        offset, rest = divmod(p.data_ptr() - base, size)
        if rest or not 0 <= offset <= flat.numel() - p.numel():
            raise RuntimeError("ZeRO-1 reduce-scatter: a parameter is not a view into DeepSpeed's flat buffer")
        spans.append((offset, p))
    spans.sort(key=lambda span: span[0])
    return [offset for offset, _ in spans], spans


class EarlyReducer:
    """What the ZeRO-1 and BF16 reducers share: DeepSpeed's optimizer and the ledger, mtds's reduce-scatter
    (``reduce_scatter_sum``, ``split_by_spans``), the late parameters, and :meth:`reduce_early` recording
    its span on the timeline. Subclasses name their early mark (``early_mark``) and do ``_reduce_early``."""

    early_mark = ""

    def __init__(self, engine, reduce_scatter_sum, split_by_spans, late_params):
        self.opt, self.book = engine.optimizer, ledger(engine)
        self.reduce_scatter_sum, self.split_by_spans, self.late_params = reduce_scatter_sum, split_by_spans, late_params
        self.pending = None     # the late ranges per group, after reduce_early
        self.timeline = None    # a TimelineRecorder: reduce_early records its span (DeepSpeed's engines)

    def reduce_early(self) -> None:
        """Reduce-scatter every gradient but the late parameters' (tied weights, whose cross-stage sum
        comes later; sequence-parallel weights, summed over TP later)."""
        self.book.mark(self.early_mark)
        if self.timeline is None:
            return self._reduce_early()
        with self.timeline.record("reduce", name="early"):
            return self._reduce_early()

    def _reduce_early(self) -> None:
        raise NotImplementedError


class Zero1ReduceScatter(EarlyReducer):
    """The reduction of one engine's ZeRO-1 optimizer, in up to two parts per step: :meth:`reduce_early`
    (a pipeline stage's gradients that are final once its last backward ends: all but ``late`` ones), then
    ``reduce_gradients`` at DeepSpeed's usual place (what is left: everything, when nothing ran early)."""

    early_mark = "Zero1ReduceScatter.reduce_early"

    def __init__(self, engine, reduce_scatter_sum, split_by_spans, late_params):
        super().__init__(engine, reduce_scatter_sum, split_by_spans, late_params)
        opt = self.opt
        self.layout = [_sorted_layout(flat, group) for flat, group in zip(opt.bit16_groups_flat, opt.bit16_groups)]
        self.bucket = int(opt.reduce_bucket_size)
        self.partitions = [CompactPartition(opt, i) for i in range(len(opt.bit16_groups))]
        self.note_sum = None    # mtds.safety.numerics.LocalNonFinite.note: where the windows' sums go

    def _fill(self, i: int):
        """Group i's gradients as a ``mtds.parallel.dp_reduce`` fill: any window of the flat buffer DeepSpeed laid
        its parameters out in (padding zero), pre-divided by the data-parallel size as DeepSpeed's
        average_tensor does -- written bucket by bucket, never as a whole flat copy. Each run of adjacent
        gradients goes in with one ``cat`` (one operator, not one copy per parameter); before the division
        the window's sum goes to ``note_sum`` (the non-finite check, mtds.safety.numerics): every element of
        this rank's own gradients passes through exactly one window, before any reduction."""
        opt = self.opt
        d = torch.distributed.get_world_size(group=opt.dp_process_group)
        size = opt.bit16_groups_flat[i].numel() // torch.distributed.get_world_size(group=opt.real_dp_process_group[i])
        starts, spans = self.layout[i]

        def fill(c: int, offset: int, dest: torch.Tensor) -> None:
            a = c * size + offset
            b = a + dest.numel()
            runs, at = [], a        # runs: [start, [pieces]] of adjacent gradients; the rest is zeroed
            # the parameters overlapping [a, b): from the last one starting at or before a
            for k in range(max(bisect.bisect_right(starts, a) - 1, 0), len(starts)):
                start, p = spans[k]
                if start >= b:
                    break
                lo, hi = max(a, start), min(b, start + p.numel())
                grad = opt.get_gradient_for_reduction(p)
                if hi <= lo or grad is None:
                    continue
                piece = grad.reshape(-1)
                if hi - lo < piece.numel():      # a parameter cut by the window: its part (else no slice)
                    piece = piece.narrow(0, lo - start, hi - lo)
                if runs and lo == at:
                    runs[-1][1].append(piece)
                else:
                    runs.append([lo, [piece]])
                at = hi
            written = a
            for lo, pieces in runs:
                if lo > written:
                    dest.narrow(0, written - a, lo - written).zero_()
                n = sum(x.numel() for x in pieces)
                torch.cat(pieces, out=dest.narrow(0, lo - a, n))
                written = lo + n
            if written < b:
                dest.narrow(0, written - a, b - written).zero_()
            if self.note_sum is not None:
                self.note_sum(dest.sum())
            if d > 1:
                dest.div_(d)
        return fill

    def _reduce(self, i: int, partition, ranges=None) -> None:
        self.reduce_scatter_sum(self._fill(i), partition.flat_partition, self.opt.real_dp_process_group[i],
                                bucket_elements=self.bucket, ranges=ranges)

    def _reduce_early(self) -> None:
        opt, late = self.opt, {id(p) for p in self.late_params()}
        self.pending = {}
        for i, group in enumerate(opt.bit16_groups):
            d = torch.distributed.get_world_size(group=opt.real_dp_process_group[i])
            size = opt.bit16_groups_flat[i].numel() // d
            spans = [(offset, offset + p.numel()) for offset, p in self.layout[i][1] if id(p) in late]
            now, later = self.split_by_spans(spans, d, size)
            partition = self.partitions[i].build()
            self._reduce(i, partition, now)
            self.pending[i] = (partition, later)

    def reduce_gradients(self, pipeline_parallel=False) -> None:
        """What DeepSpeed's ``reduce_gradients`` leaves behind, by reduce-scatter (the rest of the step's
        reduction, when :meth:`reduce_early` ran)."""
        self.book.mark(NAME)
        opt = self.opt
        if not opt.is_gradient_accumulation_boundary():
            raise RuntimeError("ZeRO-1 reduce-scatter called before the accumulation boundary")
        pending, self.pending = self.pending, None
        for i in range(len(opt.bit16_groups)):
            if pending is None:
                partition = self.partitions[i].build()
                self._reduce(i, partition)
            else:
                partition, later = pending[i]
                if any(later):
                    self._reduce(i, partition, later)
            opt.averaged_gradients[i] = partition
            opt.all_grad_tensors[i] = None
        opt._clear_param_grad_only()



def install_reduce_scatter(engine, reduce_scatter_sum, split_by_spans, late_params,
                           reducer_cls=Zero1ReduceScatter) -> Zero1ReduceScatter | None:
    """Replace the ZeRO-1 optimizer's ``reduce_gradients`` (see the module docstring); the reducer, also
    kept as ``engine.mtds_zero1_reduce`` for :func:`reduce_early`. ``reduce_scatter_sum`` and
    ``split_by_spans``: ``mtds.parallel.dp_reduce``'s; ``late_params()``: the parameters whose gradients change
    after a stage's last backward. None (nothing changed) where :func:`unsupported_reason` says
    DeepSpeed's path stays. ``reducer_cls``: ZeRO-2's on a pipeline (zero2_reduce.py)."""
    if unsupported_reason(engine) is not None:
        return None
    reducer = reducer_cls(engine, reduce_scatter_sum, split_by_spans, late_params)
    reducer.book.expect(NAME)
    drop_gradient_hooks(engine.optimizer)
    engine.optimizer.reduce_gradients = reducer.reduce_gradients
    object.__setattr__(engine, "mtds_zero1_reduce", reducer)
    return reducer


def drop_gradient_hooks(opt) -> None:
    """Remove the hook DeepSpeed's ZeRO-1 puts on every parameter's gradient accumulator (it does because
    ``contiguous_gradients`` is on, its default) and turn that flag off: under this reducer the hooks do
    nothing the step needs and cost, per backward, a Python call per parameter plus, in the first one, a walk
    from every parameter into the autograd graph (``count_used_parameters_in_backward``: a ``view_as`` each),
    and the first hook of the run allocates DeepSpeed's reduction bucket (``reduce_bucket_size`` elements:
    2 GB fp32 at DeepSpeed's default 5e8), which only DeepSpeed's own ``reduce_gradients`` uses and frees --
    replaced here, so it was held, unused, for the whole run. What the hooks also drive, the engine's
    post-backward callback, its backward prologue queues as well (torch's ``queue_callback``, checked
    here: where it is missing the hooks stay)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if not hasattr(engine, "queue_callback") or not hasattr(torch._C, "_current_graph_task_id"):
        return
    for handle in opt._grad_acc_hooks:
        handle.remove()
    opt._grad_acc_hooks = []
    opt.contiguous_gradients = False


def reduce_early(engine) -> None:
    """A pipeline stage's last backward (or W) has ended: start its reduction (no-op without the reducer)."""
    reducer = engine.__dict__.get("mtds_zero1_reduce")
    if reducer is not None:
        reducer.reduce_early()


def attach_timeline(engine, recorder) -> None:
    """--timeline on DeepSpeed's engines: the early reduction records its own span."""
    reducer = engine.__dict__.get("mtds_zero1_reduce")
    if reducer is not None:
        reducer.timeline = recorder
