"""Which pipeline schedule runs a step, checked up front.

``1f1b`` is DeepSpeed's own ``PipelineEngine``, untouched; ``dualpipev`` DeepSpeed's own
``DualPipeVEngine`` (0.19.8+) on mtds's model. ``interleaved`` and ``zb-h1``
run on mtds's ``ScheduledPipelineEngine`` (``mtds.pipe.engine``), which builds on private internals of
DeepSpeed's pipeline engine (through ``mtds.deepspeed_compat``). Both non-1f1b paths are supported for
the tested DeepSpeed range only (``mtds.deepspeed_compat.TESTED_SPEC``).
"""
from __future__ import annotations

from mtds.deepspeed_compat.capabilities import TESTED_SPEC, in_tested_range

from mtds.pipe.schedules import check_microbatches, micro_batches_fix

from mtds.parallel.choices import OWN_ENGINE, PIPELINE_SCHEDULES

__all__ = ["PIPELINE_SCHEDULES", "OWN_ENGINE", "check_schedule", "check_schedule_config", "check_weight_pass_support"]


def check_schedule(name: str, *, pp: int, virtual_stages: int, micro_batches: int | None = None,
                   samples_per_micro_batch: int | None = None) -> None:
    """``ValueError`` (one line, with the fix) for a schedule/layout/micro-batch count that cannot run;
    ``samples_per_micro_batch`` (micro batch x data-parallel size) lets the fix name a --global-batch-size."""
    if name not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown --pipeline-schedule {name!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    if name == "1f1b":
        if virtual_stages != 1:
            raise ValueError(f"--virtual-stages {virtual_stages} needs --pipeline-schedule interleaved "
                             f"(1f1b runs one chunk per rank)")
        return
    if pp < 2:
        raise ValueError(f"--pipeline-schedule {name} needs a pipeline: set --pp >= 2")
    if name == "dualpipev":
        if virtual_stages != 1:
            raise ValueError("--pipeline-schedule dualpipev places two chunks per rank itself: leave "
                             "--virtual-stages at 1")
        if micro_batches is not None and micro_batches < 2 * pp:
            raise ValueError(f"dualpipev needs at least 2 x pp = {2 * pp} micro-batches per step, got "
                             f"{micro_batches}: {micro_batches_fix(2 * pp, samples_per_micro_batch)}")
        return
    if name == "zb-h1" and virtual_stages != 1:
        raise ValueError(f"--pipeline-schedule zb-h1 runs one chunk per rank: leave --virtual-stages at 1 "
                         f"(or use --pipeline-schedule interleaved for V={virtual_stages})")
    if micro_batches is not None:
        check_microbatches(name, pp, virtual_stages, micro_batches, samples_per_micro_batch)


def check_weight_pass_support(*, bf16_immediate: bool, overlap_comm: bool) -> None:
    """ZB-H1's W writes weight gradients into ``param.grad`` after autograd is done with them, so the
    per-parameter gradient hooks of these two DeepSpeed modes would never see them."""
    if bf16_immediate:
        raise ValueError("--pipeline-schedule zb-h1 cannot use bf16.immediate_grad_update (its per-parameter "
                         "hooks never see the deferred weight gradients): set it to false")
    if overlap_comm:
        raise ValueError("--pipeline-schedule zb-h1 cannot use zero_optimization.overlap_comm (its per-parameter "
                         "hooks never see the deferred weight gradients): set it to false")


def check_schedule_config(name: str, ds_config: dict) -> None:
    """:func:`check_weight_pass_support` on a DeepSpeed config dict, before any engine exists (the engine
    checks its own state again)."""
    if name != "zb-h1":
        return
    bf16 = ds_config.get("bf16", ds_config.get("bfloat16", {})) or {}
    zero = ds_config.get("zero_optimization", {}) or {}
    check_weight_pass_support(bf16_immediate=bool(bf16.get("enabled") and bf16.get("immediate_grad_update")),
                              overlap_comm=bool(zero.get("overlap_comm", int(zero.get("stage", 0)) == 3)))


def deepspeed_version_problem(version: str) -> str | None:
    """One line if ``version`` is outside the range mtds's own schedules are built for, else None."""
    if in_tested_range(version):
        return None
    return (f"DeepSpeed {version} is outside the range mtds's pipeline schedules are built on "
            f"({TESTED_SPEC}); use --pipeline-schedule 1f1b or pip install '{TESTED_SPEC}'")
