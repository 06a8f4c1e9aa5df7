"""Patches on a built DeepSpeed engine: each replaces or wraps one method DeepSpeed calls during a step,
registers in the engine's ledger, and marks it when it runs (see ``ledger.py``).

Checked against DeepSpeed 0.19.8.
"""
from __future__ import annotations

from typing import Callable

from mtds.deepspeed_compat.ledger import ledger


def replace_fp32_clipping(engine, clip: Callable[[], float]) -> None:
    """On the fp32 path without ZeRO, DeepSpeed clips through ``engine.clip_fp32_gradients()`` (only
    when ``gradient_clipping`` > 0): run ``clip`` instead; it returns the pre-clip norm, which becomes
    the engine's reported global norm."""
    name = "DeepSpeedEngine.clip_fp32_gradients"
    book = ledger(engine)
    book.expect(name)

    def clip_fp32_gradients():
        book.mark(name)
        engine._global_grad_norm = clip()

    engine.clip_fp32_gradients = clip_fp32_gradients


def measure_before_model_step(engine, measure: Callable[[], float]) -> None:
    """Where DeepSpeed computes no norm (fp32 without ZeRO or clipping): report ``measure()`` as the
    global norm, taken just before the optimizer step (gradients are data-parallel reduced by then)."""
    name = "DeepSpeedEngine._take_model_step"
    book = ledger(engine)
    book.expect(name)
    take_model_step = engine._take_model_step

    def measured_model_step(*args, **kwargs):
        book.mark(name)
        engine._global_grad_norm = measure()
        return take_model_step(*args, **kwargs)

    engine._take_model_step = measured_model_step


def before_optimizer_step(engine, hook: Callable[[], None]) -> None:
    """Run ``hook`` just before every ``engine.optimizer.step`` (DeepSpeed's unfused 16-bit optimizer
    computes its norm inside ``step``)."""
    name = f"{type(engine.optimizer).__name__}.step"
    book = ledger(engine)
    book.expect(name)
    optimizer_step = engine.optimizer.step

    def step(*args, **kwargs):
        book.mark(name)
        hook()
        return optimizer_step(*args, **kwargs)

    engine.optimizer.step = step


def before_gradient_reduction(engine, hook: Callable[[], None]) -> None:
    """Run ``hook`` once per step, just before DeepSpeed starts the data-parallel gradient reduction:
    at the accumulation boundary it calls ``engine.allreduce_gradients`` (the plain engine from
    ``backward``, the pipeline engine from its ReduceGrads instruction)."""
    name = "DeepSpeedEngine.allreduce_gradients"
    book = ledger(engine)
    book.expect(name)
    reduction = engine.allreduce_gradients

    def allreduce_gradients(*args, **kwargs):
        if engine.is_gradient_accumulation_boundary():
            book.mark(name)
            hook()
        return reduction(*args, **kwargs)

    engine.allreduce_gradients = allreduce_gradients


def gradients_wait_in_param_grad(engine) -> bool:
    """Whether every micro-batch's gradient stays in ``param.grad`` until the accumulation boundary:
    ZeRO-0/1 with fp32/fp16 and no bucket overlap. Not so for ZeRO-2/3 and ZeRO-1 with ``overlap_comm``
    (their hooks reduce-scatter and free each gradient as backward produces it), nor for the BF16
    optimizer (it moves each micro-batch's gradient into its fp32 buffers)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() > 1 or isinstance(optimizer, BF16_Optimizer):
        return False
    return not any(getattr(optimizer, name, False)
                   for name in ("overlap_comm", "partition_gradients", "use_grad_accum_attribute"))
