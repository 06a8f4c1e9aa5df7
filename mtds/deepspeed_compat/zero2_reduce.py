"""ZeRO-2 on a pipeline (p > 1): each data-parallel rank keeps only the gradient partition it updates.

DeepSpeed 0.19.8's ``PipelineEngine`` asserts ZeRO stage < 2. Its ZeRO-2 optimizer (``DeepSpeedZeroOptimizer``
with ``partition_gradients``) would reduce from per-parameter hooks inside every backward, but a pipeline
stage then meets two walls: the tied-weight reduction across stages (``_exec_reduce_tied_grads``) sums
``weight.grad``, which ZeRO-2 has already reduced over d and freed (or turned into a view of its partition,
placed differently on each stage), and its reduction is an all-reduce per bucket (d-1)/d x 2 bytes, not a
reduce-scatter. So mtds builds DeepSpeed's optimizer at stage 1 -- the same flat buffers, partitioned
optimizer state and checkpoint files as ZeRO-1 (DeepSpeed's ZeRO-1 and ZeRO-2 files are one format), which
makes resuming between ZeRO-1 and ZeRO-2 at p > 1 a plain load -- and partitions the gradients itself, on top
of mtds's ZeRO-1 reduce-scatter (zero1_reduce.py), in one of two modes (``--zero2-pipeline-reduce``):

* ``micro-batch``: after each micro-batch's last gradient-producing action on this rank (1F1B: its backward;
  interleaved: the backward of chunk 0, the last of a micro-batch on a rank; ZB-H1: its W; DualPipeV: the
  backward of its phase 0) every gradient
  but the late ones (tied weights, summed across stages at the end of the step; sequence-parallel norm
  weights, summed over TP then) is reduce-scattered and *added* into this rank's fp32 partition, and
  ``param.grad`` dropped: between micro-batches a rank holds Ψ/d of gradient plus the late weights' whole
  gradients, not Ψ. m x the reduce-scatter's bytes per step.
* ``step``: once, after the stage's last backward -- ZeRO-1's reduce-scatter, bytes and memory exactly
  (in fp32 ZeRO-1 with mtds's reduce-scatter already frees every whole gradient after the reduction).

The late weights are reduced once, at DeepSpeed's usual place, after the tied all-reduce, in both modes.
Checked against DeepSpeed 0.19.8.
"""
from __future__ import annotations

from mtds.deepspeed_compat.zero1_reduce import Zero1ReduceScatter, install_reduce_scatter

MODES = ("micro-batch", "step")


class Zero2ReduceScatter(Zero1ReduceScatter):
    """ZeRO-1's reducer, plus :meth:`micro_batch_done` in the ``micro-batch`` mode."""

    early_mark = "Zero2ReduceScatter.reduce_early"

    def __init__(self, engine, reduce_scatter_sum, split_by_spans, late_params, mode: str):
        super().__init__(engine, reduce_scatter_sum, split_by_spans, late_params)
        if mode not in MODES:
            raise ValueError(f"ZeRO-2 pipeline reduction mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.accumulated = None     # micro-batch mode: (partition, late ranges) per group, this step

    def _ranges(self, i: int):
        opt, late = self.opt, {id(p) for p in self.late_params()}
        d = self._dp(i)
        size = opt.bit16_groups_flat[i].numel() // d
        spans = [(offset, offset + p.numel()) for offset, p in self.layout[i][1] if id(p) in late]
        return self.split_by_spans(spans, d, size)

    def _dp(self, i: int) -> int:
        import torch.distributed as dist
        return dist.get_world_size(group=self.opt.real_dp_process_group[i])

    def micro_batch_done(self) -> None:
        """Reduce-scatter (and add) every gradient but the late ones into this rank's partitions; drop them."""
        if self.mode != "micro-batch":
            return
        opt = self.opt
        first = self.accumulated is None
        if first:
            self.accumulated = {}
        late = {id(p) for p in self.late_params()}
        for i in range(len(opt.bit16_groups)):
            now, later = self._ranges(i)
            if first:
                self.accumulated[i] = (self.partitions[i].build(), later)
            partition = self.accumulated[i][0]
            self.reduce_scatter_sum(self._fill(i), partition.flat_partition, opt.real_dp_process_group[i],
                                    bucket_elements=self.bucket, ranges=now, accumulate=not first)
            for p in opt.bit16_groups[i]:
                if id(p) not in late:
                    p.grad = None

    def _reduce_early(self) -> None:
        if self.mode == "step":
            return super()._reduce_early()
        # micro-batch mode: everything but the late weights is reduced already; they come in reduce_gradients
        late = {id(p) for p in self.late_params()}
        if self.accumulated is None or any(p.grad is not None and id(p) not in late
                                           for group in self.opt.bit16_groups for p in group):
            self.micro_batch_done()     # gradients left after the last hooked action: never dropped
        self.pending, self.accumulated = self.accumulated, None

    def reduce_gradients(self, pipeline_parallel=False) -> None:
        if self.mode == "micro-batch" and self.pending is None:
            self._reduce_early()    # an engine without the early hook: the step's accumulation is pending
        super().reduce_gradients(pipeline_parallel)


def install_zero2_reduce_scatter(engine, reduce_scatter_sum, split_by_spans, late_params, mode: str):
    """Install :class:`Zero2ReduceScatter` on a stage-1 ``DeepSpeedZeroOptimizer`` (see the module docstring);
    raises where zero1_reduce's reducer cannot apply (ZeRO-2 at p > 1 has no DeepSpeed fallback)."""
    from mtds.deepspeed_compat.zero1_reduce import unsupported_reason
    reason = unsupported_reason(engine)
    if reason is not None:
        raise RuntimeError(f"ZeRO-2 with a pipeline needs mtds's reduce-scatter, which does not apply: {reason}")
    return install_reduce_scatter(engine, reduce_scatter_sum, split_by_spans, late_params,
                                  reducer_cls=lambda *args: Zero2ReduceScatter(*args, mode=mode))


def micro_batch_done(engine) -> None:
    """A micro-batch's last gradient-producing action on this rank has ended (no-op without ZeRO-2's reducer:
    this module's, or bf16_zero2.py's)."""
    done = getattr(engine.__dict__.get("mtds_zero1_reduce"), "micro_batch_done", None)
    if done is not None:
        done()
