"""DeepSpeed's BF16_Optimizer (bf16 with fp32 gradient accumulation: the shipped bf16 configs) with its
per-parameter bookkeeping done as a few operations on flat buffers.

DeepSpeed 0.19.8 runs, for every parameter and step, as Python loops: a cast and an add per micro-batch
into the fp32 buffer (``update_hp_grads``), a norm (``get_global_norm_of_tensors``) and a multiply plus a
host read of the clip decision (``clip_tensors_by_global_norm``); mtds's non-finite check added a sum per
gradient. On a GPU each is a kernel launch the host issues while the GPU idles: gpt2-medium (292
parameters) spent ~1,750 of its ~2,600 operators per step there (2026-11-24 review, operator counts).

Here the 16-bit gradients of a micro-batch are gathered into one flat buffer per parameter group, laid out
as DeepSpeed's flat 16-bit parameters (``bf16_groups_flat``) and so as its fp32 gradient buffer:
  * clearing: every 16-bit gradient set to None before a backward, so autograd hands its gradient over
    (no add into a zeroed buffer: one operator per parameter and micro-batch, 12 of a GPT-2 layer's 44);
  * gathering: one ``torch.cat(..., out=bf16_flat)`` per group after the backward (one kernel per ~64
    tensors on CUDA), then each gradient re-bound as its view of the buffer (the handed-over tensors are
    freed: between micro-batches only the buffer holds 16-bit gradients, as before);
  * accumulation: one ``fp32_flat.add_(bf16_flat)`` per group and micro-batch (each element the same
    fp32(a) + fp32(b) as before: bit-identical);
  * the non-finite check: one sum of the 16-bit buffer per group and micro-batch (every gradient this rank's
    autograd produced, before any data-parallel reduction), fed to :class:`mtds.safety.numerics.LocalNonFinite`;
  * the norm: one ``torch._foreach_norm`` over DeepSpeed's own selection (which TP/PP copies count once
    is unchanged), squares summed and reduced over the model-parallel group as DeepSpeed does;
  * clipping: one ``torch._foreach_mul_`` by ``min(1, max_norm / (norm + 1e-6))`` as a tensor: no host read
    for the decision (x * 1.0 == x, so unclipped steps are unchanged).
On CPU the ``_foreach`` operators loop over the same per-tensor kernels (bit-identical); CUDA's fused
multi-tensor norm sums in another order (relative differences of ~1e-7 in the norm).

A parameter without a gradient in a micro-batch keeps zeros in the buffer (then the group is copied tensor
by tensor). MoE param groups (since 2026-11-27) are gathered and accumulated the same way; the experts' norms
stay DeepSpeed's own (``get_norm_with_moe_layers`` calls ``deepspeed.runtime.utils``' norm, which is not
patched here; the ``moe_ep_group`` fallback below only guards other callers). ``FLAT`` is the benchmark's switch, read at every call: False runs DeepSpeed's own loops.
"""
from __future__ import annotations

import torch

from mtds.deepspeed_compat.ledger import ledger

FLAT = True     # benchmarks/gpu_bench.py's A/B switches; the product never sets them
SKIP_SINGLE_RANK_REDUCE = True
HANDOVER = True

UPDATE = "BF16_Optimizer.update_hp_grads (flat)"
REDUCE = "engine.buffered_allreduce_fallback (d = 1: nothing to reduce)"
NORM = "bf16_optimizer.get_global_norm_of_tensors (foreach)"
CLIP = "bf16_optimizer.clip_tensors_by_global_norm (foreach)"
EPS = 1e-6      # DeepSpeed's clip_tensors_by_global_norm eps

_ACTIVE: "FlatBf16Grads | None" = None    # the optimizer inside its step(): the module functions' owner


def unsupported_reason(engine) -> str | None:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    opt = engine.optimizer
    if type(opt) is not BF16_Optimizer:
        return "not DeepSpeed's BF16_Optimizer"
    # MoE param groups need nothing else: their buffers are laid out as the dense ones', and the experts' norms
    # stay DeepSpeed's (get_norm_with_moe_layers calls deepspeed.runtime.utils' own, unpatched)
    if opt.immediate_grad_update or opt._uses_muon or opt.autoep_folding_tp_group is not None:
        return "immediate gradient update, Muon or AutoEP folding"
    if opt.norm_type != 2:
        return "a norm other than 2"
    return None


class FlatBf16Grads:
    """The flat 16-bit gradient buffers of one BF16_Optimizer and its replaced methods."""

    def __init__(self, engine):
        self.opt = opt = engine.optimizer
        self.book = ledger(engine)
        self.flats = [torch.zeros_like(flat) for flat in opt.bf16_groups_flat]
        self.views = []
        for flat, group in zip(self.flats, opt.bf16_groups):
            offset, views = 0, []
            for p in group:
                views.append(flat.narrow(0, offset, p.numel()).view_as(p))
                offset += p.numel()
            self.views.append(views)
        self.bound = [[False] * len(group) for group in opt.bf16_groups]
        self.note_sum = None        # LocalNonFinite.note: where the non-finite sums go
        self.original = {name: getattr(opt, name) for name in ("update_hp_grads", "clear_lp_grads", "step")}

    # -- accumulation -----------------------------------------------------------------------------------
    def _gather(self, i: int) -> None:
        """Group ``i``'s gradients into its flat buffer, each then re-bound as its view of it."""
        opt = self.opt
        group, views = opt.bf16_groups[i], self.views[i]
        grads = [lp.grad for lp in group]
        if all(g is not None and g is not v for g, v in zip(grads, views)):
            gather_handed_over(grads, self.flats[i])
        else:   # a parameter without a gradient, or gradients already bound: tensor by tensor
            for g, view in zip(grads, views):
                if g is None:
                    view.zero_()
                elif g is not view:
                    view.copy_(g)
        for j, (lp, view) in enumerate(zip(group, views)):
            if grads[j] is None:        # no gradient this time (an unused parameter): its view stays zero
                continue
            lp.grad = view
            if not self.bound[i][j]:
                self.bound[i][j] = True
                lp._hp_grad = opt.fp32_groups_gradients[i][j]     # the pipeline's tied reduction reads it
                opt.fp32_groups_has_gradients[i][j] = True

    @torch.no_grad()
    def update_hp_grads(self, clear_lp_grads: bool = False) -> None:
        self.book.mark(UPDATE)
        if not FLAT:
            return deepspeed_loops(self.original["update_hp_grads"], clear_lp_grads)
        return accumulate_flat(self, clear_lp_grads)

    def clear_lp_grads(self, set_to_none: bool = False) -> None:
        """None whatever ``set_to_none`` says: autograd then hands its gradient over instead of adding it to
        zeros, and :meth:`_gather` collects them."""
        if not FLAT:
            return self.original["clear_lp_grads"](set_to_none=set_to_none)
        if not HANDOVER:
            return zero_bound(self)
        for group in self.opt.bf16_groups:
            for lp in group:
                lp.grad = None
        return None

    # -- norm and clipping (DeepSpeed's step calls its module's functions) ------------------------------
    def step(self, *args, **kwargs):
        global _ACTIVE
        _ACTIVE = self
        try:
            return self.original["step"](*args, **kwargs)
        finally:
            _ACTIVE = None


def accumulate_flat(owner: FlatBf16Grads, clear_lp_grads: bool) -> None:
    """One micro-batch's 16-bit gradients into the fp32 buffer: per group one gather, one sum (the
    non-finite check) and one add."""
    opt = owner.opt
    for i, flat in enumerate(owner.flats):
        owner._gather(i)
        if owner.note_sum is not None:
            owner.note_sum(flat.sum())
        opt.fp32_groups_gradients_flat[i].add_(flat)
        for j, bound in enumerate(owner.bound[i]):
            if bound:
                opt.fp32_groups_has_gradients[i][j] = True
        if clear_lp_grads:
            for lp in opt.bf16_groups[i]:
                lp.grad = None


def gather_handed_over(grads, flat: torch.Tensor) -> None:
    """One group's gradients, handed over by autograd, into its flat buffer: one operator."""
    torch.cat([g.reshape(-1) for g in grads], out=flat)


def zero_bound(owner: FlatBf16Grads) -> None:
    """``HANDOVER``'s off side (the code before 2026-11-27): every gradient bound to its view of the flat
    buffer, the buffers zeroed, so autograd adds each new gradient into its view (one operator each)."""
    for flat, group, views in zip(owner.flats, owner.opt.bf16_groups, owner.views):
        flat.zero_()
        for lp, view in zip(group, views):
            lp.grad = view


def deepspeed_loops(update_hp_grads, clear_lp_grads: bool) -> None:
    """DeepSpeed's own accumulation (a cast and an add per parameter): the switch's off side."""
    update_hp_grads(clear_lp_grads=clear_lp_grads)


def _global_norm(input_tensors, norm_type=2, mpu=None, moe_ep_group=None):
    """DeepSpeed's ``get_global_norm_of_tensors`` for the 2-norm without MoE, the per-tensor norms in one
    ``_foreach_norm``: sqrt(sum over tensors of ||t||^2, summed over the model-parallel group)."""
    owner = _ACTIVE
    if owner is not None:
        owner.book.mark(NORM)
    if owner is None or not FLAT or float(norm_type) != 2.0 or moe_ep_group is not None or not input_tensors:
        return _ORIGINAL["get_global_norm_of_tensors"](input_tensors, norm_type=norm_type, mpu=mpu,
                                                       moe_ep_group=moe_ep_group)
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    tensors = [t if t.dtype == torch.float32 else t.float() for t in input_tensors]
    total = torch.stack(torch._foreach_norm(tensors, 2.0)).pow(2.0).sum()
    if mpu is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    total = total.pow(1.0 / 2.0)
    mask_nan_or_inf_with_val_inplace(total, device=total.device)
    return total


def _clip(input_tensors, max_norm=1.0, global_norm=None, mpu=None, eps=EPS):
    """DeepSpeed's ``clip_tensors_by_global_norm``: every tensor times max_norm / (norm + eps) where that is
    below 1 -- here times min(1, that) in one ``_foreach_mul_``, the decision never read on the host."""
    owner = _ACTIVE
    if owner is not None:
        owner.book.mark(CLIP)
    if owner is None or not FLAT or global_norm is None or not torch.is_tensor(global_norm) or not input_tensors:
        return _ORIGINAL["clip_tensors_by_global_norm"](input_tensors, max_norm=max_norm, global_norm=global_norm,
                                                        mpu=mpu, eps=eps)
    coef = torch.clamp(max_norm / (global_norm + eps), max=1.0)
    torch._foreach_mul_(list(input_tensors), coef)
    return global_norm


_ORIGINAL: dict = {}


def _patch_module() -> None:
    """Route BF16_Optimizer's module-level norm and clip through this module (once per process); outside a
    flat optimizer's step they call DeepSpeed's own."""
    import deepspeed.runtime.bf16_optimizer as bf16
    if not _ORIGINAL:
        _ORIGINAL["get_global_norm_of_tensors"] = bf16.get_global_norm_of_tensors
        _ORIGINAL["clip_tensors_by_global_norm"] = bf16.clip_tensors_by_global_norm
    bf16.get_global_norm_of_tensors = _global_norm
    bf16.clip_tensors_by_global_norm = _clip


def deepspeed_reduce(fallback, grads, elements_per_buffer):
    """DeepSpeed's reduction (at d = 1 of the optimizer's own gradients: the switch's off side)."""
    return fallback(grads=grads, elements_per_buffer=elements_per_buffer)


def _skip_single_rank_reduce(engine) -> None:
    """At d = 1 DeepSpeed still "all-reduces" the fp32 gradient buffer over the one rank: cast to the
    communication dtype (bf16), reduced, multiplied by 1/1 and copied back -- three passes over the buffer
    (~2.3 ms for gpt2-medium on an H100) that also round the accumulated fp32 gradients to bf16. Skipped:
    the gradients stay as accumulated (so a d = 1 run is more exact than before, not bit-identical to it)."""
    fallback = engine.buffered_allreduce_fallback
    book = ledger(engine)
    book.expect(REDUCE)

    def reduce(grads=None, elements_per_buffer=500_000_000):
        book.mark(REDUCE)
        if grads is None and SKIP_SINGLE_RANK_REDUCE:
            return None
        return deepspeed_reduce(fallback, grads, elements_per_buffer)

    object.__setattr__(engine, "buffered_allreduce_fallback", reduce)


def install_flat_bf16(engine) -> FlatBf16Grads | None:
    """Install on ``engine``'s BF16_Optimizer (see the module docstring); None (nothing changed) where
    :func:`unsupported_reason` says DeepSpeed's loops stay. Kept as ``engine.mtds_flat_bf16``."""
    if unsupported_reason(engine) is not None:
        return None
    flat = FlatBf16Grads(engine)
    opt = flat.opt
    for name in ("update_hp_grads", "clear_lp_grads", "step"):
        setattr(opt, name, getattr(flat, name))
    _patch_module()
    flat.book.expect(UPDATE)
    flat.book.expect(NORM)
    if opt.clip_grad > 0:
        flat.book.expect(CLIP)
    object.__setattr__(engine, "mtds_flat_bf16", flat)
    from deepspeed import comm as dist
    if all(dist.get_world_size(group=g) == 1 for g in opt.real_dp_process_group):
        _skip_single_rank_reduce(engine)
    return flat
