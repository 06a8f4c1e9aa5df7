"""Which pipeline schedule runs a step.

``1f1b`` is DeepSpeed's own ``PipelineEngine``, untouched; ``dualpipev`` DeepSpeed's own
``DualPipeVEngine`` (0.19.8+) on mtds's model. ``interleaved`` and ``zb-h1``
run on mtds's ``ScheduledPipelineEngine`` (``mtds.pipe.engine``), which builds on private internals of
DeepSpeed's pipeline engine (through ``mtds.deepspeed_compat``). What each schedule needs of the layout, the
micro-batches and the DeepSpeed config is the rulebook's (mtds.rules.schedule), asked at start-up.
"""
from __future__ import annotations

from mtds.parallel.choices import OWN_ENGINE, PIPELINE_SCHEDULES
from mtds.rules.schedule import weight_pass_problem

__all__ = ["PIPELINE_SCHEDULES", "OWN_ENGINE", "check_weight_pass_support"]


def check_weight_pass_support(*, bf16_immediate: bool, overlap_comm: bool) -> None:
    """The rulebook's ZB-H1 hook rule asked of a built engine's own state (DeepSpeed's defaults included)."""
    problem = weight_pass_problem(bf16_immediate=bf16_immediate, overlap_comm=overlap_comm)
    if problem is not None:
        raise ValueError(problem)
