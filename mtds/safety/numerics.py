"""Stop at the first non-finite loss or gradient norm (bf16 / fp32), before anything poisoned is saved.

The loss and the gradient norm the check sees are reduced over ranks, so every rank sees the same
value: they cannot say where a NaN arose. ``LocalNonFinite`` records, per rank, whether any gradient
this rank computed in the step was non-finite as autograd produced it (a tensor hook: before any
reduction over data-parallel ranks), and the stop line names those ranks. A NaN travels: through the
tensor-parallel all-reduces and pipeline sends of the backward pass it reaches other ranks' gradients
too, so several ranks may be named; the data-parallel replica that produced it is exact. Weight
gradients that ZB-H1 defers to its W pass are computed outside autograd and are not seen.

fp16 is left to DeepSpeed's dynamic loss scaler, which skips an overflowing step on every rank and
lowers the scale (weights never see the inf).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """A NaN/inf loss or gradient norm; the message names the step and the ranks whose own gradients were
    non-finite."""


class LocalNonFinite:
    """Whether any gradient of ``module``'s trainable parameters was NaN/inf on this rank since the last
    :meth:`take`. Costs one ``isfinite().all()`` per parameter gradient, without a device sync."""

    def __init__(self, module: torch.nn.Module):
        self._bad: torch.Tensor | None = None
        self._handles = [p.register_hook(self._check) for p in module.parameters() if p.requires_grad]

    def _check(self, grad: torch.Tensor | None) -> None:
        if grad is None:        # a gradient deferred elsewhere (ZB-H1's W pass)
            return
        bad = ~torch.isfinite(grad).all()
        self._bad = bad if self._bad is None else self._bad | bad

    def take(self) -> bool:
        bad, self._bad = self._bad, None
        return bool(bad) if bad is not None else False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _ranks(ranks: list[int], world: int) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown} (of {world})"


def check_finite(step: int, loss: float, grad_norm: float | None, device, local_bad: bool = False) -> None:
    """Raise :class:`NonFiniteError` on every rank if any rank sees a non-finite loss or grad norm.

    ``local_bad``: this rank's own gradients were non-finite this step (:class:`LocalNonFinite`)."""
    bad = not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    # [any rank saw a non-finite loss/norm, then one flag per rank: its own gradients were non-finite]
    flags = torch.zeros(world + 1, dtype=torch.int64, device=device)
    flags[0], flags[1 + rank] = int(bad), int(local_bad)
    if world > 1:
        dist.all_reduce(flags)
    if not flags[0]:
        return
    what = (f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}") if bad else \
        "a non-finite loss or gradient norm"
    origin = [r for r in range(world) if flags[1 + r]]
    where = (f"own gradients non-finite on {_ranks(origin, world)}" if origin else
             "no rank's own gradients were non-finite (the loss or the norm's reduction overflowed)")
    raise NonFiniteError(f"step {step}: {what} (reduced over ranks: every rank sees it); {where}; stopped before "
                         f"saving the poisoned state (lower --lr, raise warm-up or clipping, or resume from the last "
                         f"checkpoint)")
