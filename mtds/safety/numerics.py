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
    :meth:`take`. Each gradient costs one ``sum()`` (no device sync): a NaN or inf anywhere makes the sum
    non-finite. The sum of finite values overflows only past 3.4e38, where the gradient norm (a sum of
    squares) has long overflowed too; ``isfinite().all()`` per gradient cost 17 ms per micro-batch at
    4.5 M parameters on one CPU core, the sums 0.5-1.4 ms."""

    def __init__(self, module: torch.nn.Module, flat=None, reducer=None):
        """``flat``: a :class:`mtds.deepspeed_compat.bf16_flat.FlatBf16Grads` whose 16-bit gradients all
        accumulate in flat buffers: while its switch is on it sums each buffer once per micro-batch instead
        (see :meth:`note`), and the per-gradient sums are skipped. ``reducer``: a
        :class:`mtds.deepspeed_compat.zero1_reduce.Zero1ReduceScatter`, which copies every gradient of the
        step into its buckets before reducing them: it sums each bucket instead (no hooks at all; ZB-H1's
        deferred weight gradients are then seen too)."""
        self._sums: list[torch.Tensor] = []
        self._flat = None
        if flat is not None:
            import mtds.deepspeed_compat.bf16_flat as flat_module
            self._flat = flat_module
            flat.note_sum = self.note
        self._handles = []
        if reducer is not None and hasattr(reducer, "note_sum"):
            reducer.note_sum = self.note
            return
        self._handles = [p.register_hook(self._check) for p in module.parameters() if p.requires_grad]

    def _check(self, grad: torch.Tensor | None) -> None:
        if grad is None:        # a gradient deferred elsewhere (ZB-H1's W pass)
            return
        if self._flat is not None and self._flat.FLAT:
            return
        self._sums.append(grad.detach().sum())

    def note(self, total: torch.Tensor) -> None:
        """A sum over many gradients at once (non-finite if any element is)."""
        self._sums.append(total)

    def take_flag(self) -> torch.Tensor | None:
        """This step's answer as a 0-dim bool tensor on the gradients' device (no host sync); None if no
        gradient was seen. Starts the next step."""
        sums, self._sums = self._sums, []
        if not sums:
            return None
        return ~torch.isfinite(torch.stack([s.float() for s in sums])).all()

    def take(self) -> bool:
        flag = self.take_flag()
        return bool(flag) if flag is not None else False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _ranks(ranks: list[int], world: int) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown} (of {world})"


class StepFlags:
    """What every rank must agree on after a step, in one all-reduce (MAX) and one host read: whether any
    rank saw a non-finite loss or grad norm, the signal any rank received (0: none) and, per rank, whether
    its own gradients were non-finite."""

    def __init__(self, values: list[int]):
        self.any_nonfinite, self.signal, self.own = bool(values[0]), values[1], values[2:]

    @classmethod
    def agree(cls, loss: float, grad_norm: float | None, device, local_bad: torch.Tensor | bool | None = None,
              signal: int = 0, check: bool = True) -> "StepFlags":
        """``check``: False where a non-finite loss/norm is not this step's business (fp16's loss scaler,
        ``--on-nan skip`` on a skipped step); the flags are still exchanged, so every rank calls this."""
        bad = check and (not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)))
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        flags = torch.zeros(world + 2, dtype=torch.int64, device=device)
        flags[0], flags[1] = int(bad), int(signal)
        if local_bad is not None:
            flags[2 + rank] = local_bad if isinstance(local_bad, bool) else local_bad.to(device=device,
                                                                                         dtype=torch.int64)
        if world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return cls(flags.tolist())

    def raise_if_nonfinite(self, step: int, loss: float, grad_norm: float | None) -> None:
        if not self.any_nonfinite:
            return
        world = len(self.own)
        bad = not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))
        what = (f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}") if bad else \
            "a non-finite loss or gradient norm"
        origin = [r for r in range(world) if self.own[r]]
        where = (f"own gradients non-finite on {_ranks(origin, world)}" if origin else
                 "no rank's own gradients were non-finite (the loss or the norm's reduction overflowed)")
        raise NonFiniteError(f"step {step}: {what} (reduced over ranks: every rank sees it); {where}; stopped "
                             f"before saving the poisoned state (lower --lr, raise warm-up or clipping, or resume "
                             f"from the last checkpoint)")
