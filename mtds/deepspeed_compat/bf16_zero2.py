"""bf16 ZeRO-2 on a pipeline (p > 1): DeepSpeed's BF16_Optimizer (bf16 working weights, fp32 master partition
and gradient accumulation) without its full-size fp32 gradient buffer.

ZeRO-2/3 at p > 1 build DeepSpeed's optimizer at stage 1 (zero2_reduce.py says why); in bf16 with fp32
accumulation that is BF16_Optimizer, which mtds already runs on flat buffers (bf16_flat.py: one full-size
bf16 gradient buffer per group) and reduce-scatters (bf16_reduce.py: the full-size fp32 accumulation buffer,
its partitions reduced in the communication dtype, bf16, and divided by d there). Per rank that is 2Ψ bf16 +
4Ψ fp32 of gradient buffers, held for the whole run. Here, by ``--zero2-pipeline-reduce``:

* ``step``: bf16_reduce.py's reduction unchanged (the same operations: bit-identical to ZeRO-1 bf16), and
  both gradient buffers' storage released after every optimizer step and re-allocated (the fp32 one zeroed)
  at the next step's first gradient: between steps a rank holds no gradient bytes (ZeRO-1 holds 6Ψ); during
  the step's backwards the same 6Ψ as ZeRO-1. The traffic: ZeRO-1's.
* ``micro-batch`` (the memory mode): neither buffer exists. Autograd leaves a micro-batch's bf16 gradients
  in ``param.grad``; after the micro-batch's last gradient-producing action on this rank (zero2_reduce.py's
  hook points) they are reduce-scattered, bucket by bucket straight from ``param.grad`` (a transient of at most
  ``reduce_bucket_size`` elements), in the communication dtype, divided by d there, and *added* into this
  rank's own fp32 gradient partition (Ψ/d), then dropped. The late weights (tied, summed across stages
  after the last backward: DeepSpeed's tied reduction reads ``_hp_grad``) accumulate in fp32 buffers of
  their own, whole, after every backward, and are reduce-scattered once at the end of the step. Between
  micro-batches a rank holds 4Ψ/d + 4Ψ_late gradient bytes, between steps none (released after the step,
  re-allocated at the next one's first gradient). m x the reduce-scatter's bytes per step.
  The arithmetic differs from ZeRO-1's: each micro-batch's gradient is rounded to bf16 for the reduction and
  summed over micro-batches in fp32 after it, where ZeRO-1 sums the micro-batches in fp32 and rounds once
  (within a micro-batch the gradients of one parameter from two passes, ZB-H1's B and W, add in bf16).

The norm is taken over the partition (as bf16_reduce.py does), clipping scales the partition, the step reads
it. Checkpoints are ZeRO-1 bf16's (BF16_Optimizer's files: no gradients in them). Dense models only, no
sequence-parallel deferred gradients (BF16_Optimizer's path sums them over TP per use). Checked against
DeepSpeed 0.19.8.
"""
from __future__ import annotations

import bisect

import torch
import torch.distributed as dist

from mtds.deepspeed_compat import bf16_flat
from mtds.deepspeed_compat.bf16_reduce import EARLY_BUCKET, NORM, REDUCE, Bf16ReduceScatter

MODES = ("micro-batch", "step")


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


def _reallocate(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


class Bf16Zero2(Bf16ReduceScatter):
    """The ``step`` mode (see the module docstring); :class:`Bf16Zero2MicroBatch` the ``micro-batch`` mode."""

    early_mark = "Bf16Zero2.reduce_early"
    mode = "step"

    def __init__(self, engine, reduce_scatter_sum, split_by_spans, late_params, flat: bf16_flat.FlatBf16Grads):
        super().__init__(engine, reduce_scatter_sum, split_by_spans, late_params)
        self.flat = flat
        self.update = flat.update_hp_grads       # bf16_flat's: gather, then add into the fp32 buffer
        self.clear_hp = self.opt.clear_hp_grads

    def install(self) -> None:
        opt = self.opt
        opt.update_hp_grads, opt.clear_hp_grads = self.update_hp_grads, self.clear_hp_grads
        step = opt.step

        def step_then_free(*args, **kwargs):
            try:
                return step(*args, **kwargs)
            finally:
                self.free()
        opt.step = step_then_free

    def buffers(self) -> list[torch.Tensor]:
        return list(self.opt.fp32_groups_gradients_flat) + list(self.flat.flats)

    def free(self) -> None:
        """Release both gradient buffers (every bf16 gradient, a view of its buffer, dropped first)."""
        for group in self.opt.bf16_groups:
            for lp in group:
                lp.grad = None
        for t in self.buffers():
            if _allocated(t):
                _free(t)
        self.__dict__.pop("_piece_cache", None)     # its slices point into the released storage

    def update_hp_grads(self, clear_lp_grads: bool = False) -> None:
        if not _allocated(self.opt.fp32_groups_gradients_flat[0]):
            for t in self.buffers():
                _reallocate(t)
            for t in self.opt.fp32_groups_gradients_flat:
                t.zero_()
        return self.update(clear_lp_grads)

    def clear_hp_grads(self) -> None:
        if _allocated(self.opt.fp32_groups_gradients_flat[0]):
            return self.clear_hp()
        for i, group in enumerate(self.opt.fp32_groups_gradients):     # nothing held: only the flags
            self.opt.fp32_groups_has_gradients[i] = [False] * len(group)
        return None

    def micro_batch_done(self) -> None:
        return None


class Bf16Zero2MicroBatch(Bf16Zero2):
    """The ``micro-batch`` mode: the fp32 gradient partitions of their own, no full-size gradient buffer."""

    early_mark = "Bf16Zero2MicroBatch.reduce_early"
    mode = "micro-batch"

    def __init__(self, engine, reduce_scatter_sum, split_by_spans, late_params, flat):
        super().__init__(engine, reduce_scatter_sum, split_by_spans, late_params, flat)
        opt = self.opt
        self.bucket = int(engine._config.zero_config.reduce_bucket_size)
        self.comm_dtype = engine.communication_data_type
        self.d_all = dist.get_world_size(self.group)
        # each parameter's place: (group, index, offset in the group's flat layout), by offset per group
        self.layout, self.where = [], {}
        for i, (flat_grads, group) in enumerate(zip(opt.fp32_groups_gradients_flat, opt.fp32_groups_gradients)):
            base, size = flat_grads.data_ptr(), flat_grads.element_size()
            spans = sorted(((g.data_ptr() - base) // size, j) for j, g in enumerate(group))
            self.layout.append(spans)
            for offset, j in spans:
                self.where[id(group[j])] = (i, offset)
        self.views = [list(group) for group in opt.fp32_groups_gradients]     # kept: the ids above stay theirs
        late = {id(p) for p in late_params()}
        self.late = {}      # id(lp) -> its whole fp32 gradient (tied weights: the tied reduction reads _hp_grad)
        for group in opt.bf16_groups:
            for lp in group:
                if id(lp) in late:
                    self.late[id(lp)] = lp._hp_grad = torch.zeros(lp.shape, dtype=torch.float32, device=lp.device)
        self.partitions = [torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                           for p in opt.fp32_groups_gradient_flat_partition]
        self.ranges = []    # per group: (now, later) = the partition ranges outside / inside the late weights
        for i, group in enumerate(opt.bf16_groups):
            d = dist.get_world_size(self.groups[i])
            spans = [(offset, offset + group[j].numel()) for offset, j in self.layout[i] if id(group[j]) in late]
            self.ranges.append(self.split_by_spans(spans, d, self.partitions[i].numel()))
        self.reduced = False    # any micro-batch reduced this step

    def install(self) -> None:
        super().install()
        opt = self.opt
        opt.clear_lp_grads = self.clear_lp_grads
        opt.fp32_groups_gradient_flat_partition[:] = self.partitions      # what DeepSpeed's step reads
        for t in self.buffers():
            _free(t)

    def free(self) -> None:
        """After the step: the partitions and late buffers released too (nothing full-size is ever allocated)."""
        for t in self.partitions + list(self.late.values()):
            if _allocated(t):
                _free(t)
        self.__dict__.pop("_piece_cache", None)

    def _ensure(self) -> None:
        """The step's first use: the partitions and late buffers re-allocated, zeroed."""
        if _allocated(self.partitions[0]):
            return
        for t in self.partitions + list(self.late.values()):
            _reallocate(t)
            t.zero_()

    # -- each backward (and W): the late weights into fp32; the rest waits in param.grad -----------------
    @torch.no_grad()
    def update_hp_grads(self, clear_lp_grads: bool = False) -> None:
        self.flat.book.mark(bf16_flat.UPDATE)
        self._ensure()
        opt = self.opt
        for i, group in enumerate(opt.bf16_groups):
            for j, lp in enumerate(group):
                buffer = self.late.get(id(lp))
                if buffer is None or lp.grad is None:
                    continue
                if self.flat.note_sum is not None:
                    self.flat.note_sum(lp.grad.sum())
                buffer.add_(lp.grad.view(buffer.shape))
                opt.fp32_groups_has_gradients[i][j] = True
                lp.grad = None

    def clear_lp_grads(self, set_to_none: bool = False) -> None:
        """A micro-batch's other gradients stay in ``param.grad`` until it is done (autograd adds a second
        pass's into them); the late ones were folded into fp32 already."""
        for group in self.opt.bf16_groups:
            for lp in group:
                if id(lp) in self.late:
                    lp.grad = None

    def _fill(self, i: int, late: bool):
        """Group i's bf16 gradients (``late``: the late weights' fp32 ones) as a ``mtds.parallel.dp_reduce`` fill
        of any window of its flat layout (padding and every other parameter zero)."""
        opt = self.opt
        group, spans = opt.bf16_groups[i], self.layout[i]
        starts = [offset for offset, _ in spans]
        size = self.partitions[i].numel()
        note = self.flat.note_sum if not late else None

        def fill(c: int, offset: int, dest: torch.Tensor) -> None:
            a = c * size + offset
            b = a + dest.numel()
            dest.zero_()
            for k in range(max(bisect.bisect_right(starts, a) - 1, 0), len(spans)):
                start, j = spans[k]
                if start >= b:
                    break
                lp = group[j]
                grad = self.late.get(id(lp)) if late else (None if id(lp) in self.late else lp.grad)
                lo, hi = max(a, start), min(b, start + lp.numel())
                if grad is None or hi <= lo:
                    continue
                dest.narrow(0, lo - a, hi - lo).copy_(grad.reshape(-1).narrow(0, lo - start, hi - lo))
            if note is not None:
                note(dest.sum())
        return fill

    def _reduce_into(self, i: int, ranges, late: bool) -> None:
        self.reduce_scatter_sum(self._fill(i, late), self.partitions[i], self.groups[i], bucket_elements=self.bucket,
                                ranges=ranges, dtype=self.comm_dtype, post_scale=1.0 / self.d_all, accumulate=True)

    @torch.no_grad()
    def micro_batch_done(self) -> None:
        """Reduce-scatter (and add) every gradient but the late ones into this rank's fp32 partitions; drop them."""
        self._ensure()
        opt = self.opt
        for i, group in enumerate(opt.bf16_groups):
            self._reduce_into(i, self.ranges[i][0], late=False)
            for j, lp in enumerate(group):
                if lp.grad is not None and id(lp) not in self.late:
                    opt.fp32_groups_has_gradients[i][j] = True
                    lp.grad = None
        self.reduced = True

    def _waiting(self) -> bool:
        return any(lp.grad is not None and id(lp) not in self.late for group in self.opt.bf16_groups for lp in group)

    def _reduce_early(self) -> None:
        if not self.reduced or self._waiting():
            self.micro_batch_done()     # gradients left after the last hooked action: never dropped
        self.pending = [later for _, later in self.ranges]

    def reduce(self, grads=None, elements_per_buffer=EARLY_BUCKET) -> None:
        if grads is not None:       # someone else's gradients: DeepSpeed's all-reduce
            return self.fallback(grads=grads, elements_per_buffer=elements_per_buffer)
        self.book.mark(REDUCE)
        if self.pending is None:
            self._reduce_early()
        pending, self.pending = self.pending, None
        for i, later in enumerate(pending):
            if any(later):
                self._reduce_into(i, later, late=True)
        self.reduced = False
        return None

    def clear_hp_grads(self) -> None:
        if _allocated(self.partitions[0]):
            for t in self.partitions + list(self.late.values()):
                t.zero_()
        for i, group in enumerate(self.opt.fp32_groups_gradients):
            self.opt.fp32_groups_has_gradients[i] = [False] * len(group)

    def norm_tensors(self, for_clipping=False):
        if for_clipping:        # the step reads only the partitions: scale them
            return list(self.partitions)
        return super().norm_tensors(for_clipping)

    def _in_partition(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` (a parameter's fp32 gradient view, DeepSpeed's selection) as its slice of this rank's partition."""
        i, offset = self.where[id(t)]
        partition = self.partitions[i]
        start = dist.get_rank(self.groups[i]) * partition.numel()
        lo, hi = max(offset, start), min(offset + t.numel(), start + partition.numel())
        return [partition[lo - start:hi - start]] if hi > lo else []


def install_bf16_zero2(engine, reduce_scatter_sum, split_by_spans, late_params, mode: str) -> Bf16Zero2:
    """bf16 ZeRO-2 at p > 1 on DeepSpeed's stage-1 BF16_Optimizer (see the module docstring); kept as
    ``engine.mtds_zero1_reduce`` (zero1_reduce.reduce_early, zero2_reduce.micro_batch_done find it there)."""
    from mtds.deepspeed_compat.bf16_reduce import unsupported_reason
    if mode not in MODES:
        raise ValueError(f"ZeRO-2 pipeline reduction mode must be one of {MODES}, got {mode!r}")
    reason = unsupported_reason(engine)
    flat = engine.__dict__.get("mtds_flat_bf16")
    if reason is None and (flat is None or not bf16_flat.FLAT):
        reason = "BF16_Optimizer's bookkeeping is not on flat buffers (bf16_flat.py)"
    if reason is not None:
        raise RuntimeError(f"bf16 ZeRO-2 with a pipeline needs mtds's BF16 reduce-scatter, which does not apply: {reason}")
    cls = Bf16Zero2MicroBatch if mode == "micro-batch" else Bf16Zero2
    reducer = cls(engine, reduce_scatter_sum, split_by_spans, late_params, flat)
    reducer.book.expect(REDUCE)
    reducer.book.expect(NORM)
    object.__setattr__(engine, "buffered_allreduce_fallback", reducer.reduce)
    reducer.opt.get_grads_for_norm = reducer.norm_tensors
    reducer.install()
    object.__setattr__(engine, "mtds_zero1_reduce", reducer)
    return reducer
