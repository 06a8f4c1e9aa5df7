"""ZeRO-1's gradient reduction as a reduce-scatter: each data-parallel rank reduces only the partition of
the flat gradient whose optimizer state it owns (Megatron's distributed optimizer; ZeRO §5.1's
"P_os" reduce-scatter), so a step moves 2Ψ(d−1)/d bytes per rank (this reduce-scatter, then the
parameter all-gather DeepSpeed already does) instead of 3Ψ(d−1)/d.

Why not DeepSpeed's own options (0.19.8, ``DeepSpeedZeroOptimizer.average_tensor``): with
``reduce_scatter`` on (its default) each bucket is all-reduced and each rank keeps its partition
(``use_multi_rank_bucket_allreduce``, default on: 2Ψ(d−1)/d), or reduced to each partition's owner with
one ``dist.reduce`` per owner (off: Ψ per rank by the ring convention, d collectives per bucket);
with it off, every bucket is all-reduced. None reduce-scatters.

What replaces ``optimizer.reduce_gradients`` (the engine calls it at the accumulation boundary, from
``backward`` or a pipeline's ReduceGrads): per parameter group, the gradients are laid out as DeepSpeed
laid the parameters out in its flat buffer (zero padding included), pre-divided by d as DeepSpeed does,
and reduce-scattered (``mtds.dp_reduce``) straight into the flat gradient partition DeepSpeed's
``step`` reads (its compact partition buffer, with per-parameter views for the norm and the overflow
check). Then every ``param.grad`` is dropped, as DeepSpeed's own epilogue does.

Installed only where that is exactly DeepSpeed's state otherwise: stage 1, gradients in ``param.grad`` in
the communication dtype (no separate fp32 accumulation, no bucket overlap, no CPU offload), no MoE,
Muon, ZenFlow or sequence-parallel (Ulysses) group. Checked against DeepSpeed 0.19.8.
"""
from __future__ import annotations

import torch

from .ledger import ledger

NAME = "DeepSpeedZeroOptimizer.reduce_gradients"


def unsupported_reason(engine) -> str | None:
    """Why this engine's ZeRO-1 optimizer keeps DeepSpeed's reduction (None: the reduce-scatter applies)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    opt = engine.optimizer
    if engine.zero_optimization_stage() != 1 or not isinstance(opt, DeepSpeedZeroOptimizer):
        return "not DeepSpeed's ZeRO-1 optimizer"
    if opt.partition_gradients or opt.overlap_comm or opt.cpu_offload or opt.use_grad_accum_attribute:
        return "ZeRO-1 with overlap_comm, CPU offload or separate gradient accumulation"
    if opt.has_moe_layers or opt.zenflow or opt.sequence_parallel_size != 1 or not opt.reduce_scatter:
        return "MoE, ZenFlow, sequence-parallel groups or reduce_scatter off"
    if opt.communication_data_type != opt.dtype or opt.gradient_accumulation_dtype != opt.dtype:
        return "gradients communicated or accumulated in another dtype"
    if any(opt._is_muon_group(group) for group in opt.bit16_groups if group):
        return "Muon parameter groups"
    if not opt.gradient_average:
        return "gradient averaging off"
    return None


def _offsets(flat: torch.Tensor, params) -> list[int]:
    """Each parameter's element offset in DeepSpeed's flat buffer (its ``.data`` is a view into it)."""
    base, size = flat.data_ptr(), flat.element_size()
    offsets = []
    for p in params:
        offset, rest = divmod(p.data_ptr() - base, size)
        if rest or not 0 <= offset <= flat.numel() - p.numel():
            raise RuntimeError("ZeRO-1 reduce-scatter: a parameter is not a view into DeepSpeed's flat buffer")
        offsets.append(offset)
    return offsets


def install_reduce_scatter(engine, reduce_scatter_sum) -> bool:
    """Replace the ZeRO-1 optimizer's ``reduce_gradients`` (see the module docstring). ``reduce_scatter_sum
    (flat, out, group, bucket_elements=)`` sums partition r of every rank's ``flat`` into ``out``.
    Returns False (and changes nothing) where :func:`unsupported_reason` says DeepSpeed's path stays."""
    if unsupported_reason(engine) is not None:
        return False
    opt = engine.optimizer
    book = ledger(engine)
    book.expect(NAME)
    layout = [_offsets(flat, group) for flat, group in zip(opt.bit16_groups_flat, opt.bit16_groups)]
    bucket = int(opt.reduce_bucket_size)

    def reduce_gradients(pipeline_parallel=False):
        book.mark(NAME)
        if not opt.is_gradient_accumulation_boundary():
            raise RuntimeError("ZeRO-1 reduce-scatter called before the accumulation boundary")
        for i, (flat_params, group) in enumerate(zip(opt.bit16_groups_flat, opt.bit16_groups)):
            dp_group = opt.real_dp_process_group[i]
            grads = torch.zeros_like(flat_params)            # padding reduces as zeros, as DeepSpeed's does
            for p, offset in zip(group, layout[i]):
                grad = opt.get_gradient_for_reduction(p)
                if grad is not None:
                    grads.narrow(0, offset, p.numel()).copy_(grad.reshape(-1))
            # DeepSpeed pre-divides by the data-parallel size, then sums (average_tensor)
            grads.div_(torch.distributed.get_world_size(group=opt.dp_process_group))
            partition = opt._build_compact_grad_partition_buffer(i)
            reduce_scatter_sum(grads, partition.flat_partition, dp_group, bucket_elements=bucket)
            opt.averaged_gradients[i] = partition
            opt.all_grad_tensors[i] = None
        opt._clear_param_grad_only()

    opt.reduce_gradients = reduce_gradients
    return True
