"""ZeRO-1/2's step without re-pointing every parameter that already points where it should.

After each step DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer.step`` calls ``_update_model_bit16_weights`` per
group ("TODO: we probably don't need this? just to be safe"): every parameter's ``.data`` is set again to its
slice of the group's flat buffer -- a narrow, a view and two ``.data`` reads per parameter, four operators
each step (400 of the ~2,000 of a tiny 8-layer GPT-2 step, benchmarks/bench_host.py, 2026-11-27). The
all-gather writes the flat buffer in place, so the parameters already are those slices; here the group is
re-pointed only when some parameter is not (its storage address, shape or strides differ: checked on the
host, no operator), which is what DeepSpeed's call would change. Values are never touched either way.
"""
from __future__ import annotations

from mtds.deepspeed_compat.zero_norm import unsupported_reason   # the same ZeRO-1/2 optimizers, the same exceptions


def already_pointing(opt, group_index: int) -> bool:
    """Whether every parameter of the group is its slice of the flat buffer, as DeepSpeed would set it."""
    flat = opt.bit16_groups_flat[group_index]
    base, size = flat.data_ptr(), flat.element_size()
    for p, meta, offset in zip(opt.round_robin_bit16_groups[group_index], opt.round_robin_bit16_meta[group_index],
                               opt.round_robin_bit16_offsets[group_index]):
        if (p.data_ptr() != base + offset * size or p.shape != meta.shape or not p.is_contiguous()
                or p.dtype != flat.dtype):
            return False
    return True


def install_skip_repoint(engine) -> bool:
    """Wrap ``engine.optimizer._update_model_bit16_weights`` (see the module docstring); False where DeepSpeed's
    stays as is (:func:`unsupported_reason`)."""
    if unsupported_reason(engine) is not None:
        return False
    opt = engine.optimizer
    original = opt._update_model_bit16_weights

    def update_model_bit16_weights(group_index):
        if not already_pointing(opt, group_index):
            original(group_index)

    opt._update_model_bit16_weights = update_model_bit16_weights
    return True
