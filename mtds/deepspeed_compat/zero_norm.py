"""ZeRO-1/2's gradient norm with one ``torch._foreach_norm`` instead of a cast and a norm per gradient.

DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer.get_grad_norm_direct`` takes, for every gradient of its
partition in a Python loop, ``vector_norm(g.to(float64))``: two operators per parameter per step (a
copy to float64 and the norm), 2 x 100 of the ~2,700 operators of a tiny 8-layer GPT-2 step on CPU
(benchmarks/bench_host.py, 2026-11-27). Here the same selection of gradients (no padding, no
pipeline-replicated copies, tensor-parallel duplicates on model-parallel rank 0 only) goes to one
``_foreach_norm(..., dtype=float64)``, which casts each tensor inside the operator; the squares are summed,
reduced and rooted exactly as DeepSpeed does. On CPU ``_foreach_norm`` runs the same per-tensor kernel:
the norm is DeepSpeed's bit for bit. CUDA's multi-tensor kernel sums each tensor's squares in another
order (float64: differences of ~1e-16 relative).

``FOREACH`` is the benchmarks' switch, read at every call: False calls DeepSpeed's own loop.
"""
from __future__ import annotations

import torch

FOREACH = True


def unsupported_reason(engine) -> str | None:
    """Why DeepSpeed's own ZeRO-1/2 code stays (here and in zero_repoint.py); None: the patch applies."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer):
        return "not DeepSpeed's ZeRO-1/2 optimizer"
    if opt.cpu_offload or opt.has_moe_layers:
        return "CPU offload or MoE (their norms take other paths)"
    return None


def install_foreach_norm(engine) -> bool:
    """Replace ``engine.optimizer.get_grad_norm_direct`` (see the module docstring); False where DeepSpeed's
    stays (:func:`unsupported_reason`)."""
    if unsupported_reason(engine) is not None:
        return False
    opt = engine.optimizer
    original = opt.get_grad_norm_direct
    selections = {}

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if not FOREACH or float(norm_type) != 2.0:
            return original(gradients, params, norm_type)
        return _foreach_grad_norm(opt, _selected(opt, gradients, params, selections))

    opt.get_grad_norm_direct = get_grad_norm_direct
    return True


def _selected(opt, gradients, params, selections: dict) -> list:
    """The gradients that count in the norm: DeepSpeed's selection, made once per parameter list (a group's
    partition: its padding pieces and its parameters' flags do not change) and kept as positions in
    ``gradients`` -- the walk over every piece and parameter ran each step."""
    key = (id(params), len(gradients))
    hit = selections.get(key)
    if hit is None or hit[0] is not params:
        from deepspeed.runtime.constants import PIPE_REPLICATED
        from deepspeed.runtime.utils import is_model_parallel_parameter
        pieces = [k for k, g in enumerate(gradients) if not getattr(g, "_zero_padding", False)]
        positions = []
        for k, p in zip(pieces, params):
            if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:      # counted on the stage that owns it
                continue
            if is_model_parallel_parameter(p) or opt.model_parallel_rank == 0:
                positions.append(k)
        hit = selections[key] = (params, positions)
    return [gradients[k] for k in hit[1]]      # plain tensors (no grad): no detach per parameter


def _foreach_grad_norm(opt, selected: list) -> torch.Tensor:
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype
    if selected:
        norms = torch._foreach_norm(selected, 2.0, dtype=get_norm_dtype())
        total = torch.stack(norms).pow(2.0).sum().float()
    else:
        total = torch.tensor(0.0, dtype=torch.float32).to(opt.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=opt.dp_process_group)
    opt._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.pow(1.0 / 2.0)
    mask_nan_or_inf_with_val_inplace(total, device=opt.device)
    return total
