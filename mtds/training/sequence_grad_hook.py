"""Sum sequence-parallel parameters' gradients over the TP group once per step where DeepSpeed allows.

At the gradient-accumulation boundary DeepSpeed calls ``engine.allreduce_gradients`` (the plain
engine from ``backward``, the pipeline engine from its ReduceGrads instruction) to start the
data-parallel reduction; the TP sum runs just before it, so clipping and the optimizer see summed
gradients. That needs each micro-batch's gradient to accumulate in ``param.grad`` until then, which
holds for ZeRO-0/1 with fp32 or fp16. Elsewhere the sum stays per use (inside backward):
  - ZeRO-2/3 reduce-scatter each gradient over data parallelism as soon as backward produces it and
    free ``param.grad``, so the TP partial sums must be added before that hook, i.e. per use;
  - ZeRO-1 with ``overlap_comm`` does the same for its buckets;
  - DeepSpeed's BF16_Optimizer moves every micro-batch's bf16 gradient into its fp32 buffers.
"""
from __future__ import annotations

from mtds.deepspeed_compat import patches
from mtds.parallel.layout import ParallelGroups
from mtds.tp import allreduce_sequence_parallel_grads


def defer_sequence_parallel_grads(engine, groups: ParallelGroups) -> bool:
    """Switch the model's sequence-parallel parameters to one flat TP all-reduce per step; False
    (and per-use sums) where the DeepSpeed path does not keep gradients until the boundary."""
    params = [p for p in engine.module.parameters() if getattr(p, "sequence_parallel", False) and p.requires_grad]
    if not params or groups.layout.tp == 1 or not patches.gradients_wait_in_param_grad(engine):
        return False
    for p in params:
        p.sequence_parallel_grads_deferred = True
    patches.before_gradient_reduction(engine, lambda: allreduce_sequence_parallel_grads(params, groups.tp_group))
    return True
