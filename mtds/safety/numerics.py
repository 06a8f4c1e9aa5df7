"""Stop at the first non-finite loss or gradient norm (bf16 / fp32), before anything poisoned is saved.

fp16 is left to DeepSpeed's dynamic loss scaler, which skips an overflowing step on every rank and
lowers the scale (weights never see the inf).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """A NaN/inf loss or gradient norm; the message names the step and the first rank that saw it."""


def check_finite(step: int, loss: float, grad_norm: float | None, device) -> None:
    """Raise :class:`NonFiniteError` on every rank if any rank sees a non-finite loss or grad norm."""
    bad = not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    first = torch.tensor([rank if bad else world], dtype=torch.int64, device=device)
    if world > 1:
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
    first_rank = int(first.item())
    if first_rank < world:
        what = (f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}") if bad else \
            "a non-finite loss or gradient norm"
        raise NonFiniteError(f"step {step}: {what} on rank {first_rank}; stopped before saving the poisoned state "
                             f"(lower --lr, raise warm-up or clipping, or resume from the last checkpoint)")
