"""What train.py can run: the rulebook's verdict (mtds.rules) on a candidate, the same rules train.py's start-up
asks (mtds.training.admit). A layout the planner calls runnable is one train.py starts.

The planner describes a candidate as train.py would run it: ``mtds-plan``'s knobs as train.py's flags, the
workload's precision and batch, the DeepSpeed installed here, and the stage partition train.py would build
without ``--pipeline-layout`` (its default balancing, priced as train.py prices it, within this cluster's
memory) where a rule weighs it. Rules of kind "cannot" (shapes that do not divide, schedules that cannot take
the micro-batches) also make a layout infeasible; rules of kind "not built" only unrunnable, so
``--include-unrunnable`` still ranks what the planner can model but train.py does not run yet.
"""
from __future__ import annotations

import functools
from importlib import metadata

from mtds import rules
from mtds.rules.job import Job


@functools.cache
def installed_deepspeed() -> str | None:
    """The installed DeepSpeed's version, read once without importing it (the planner stays torch-free)."""
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None


def job_of(model, layout, work, stages=None) -> Job:
    """The job train.py would run for ``layout`` (a :class:`~mtds.plan.candidate.Candidate`) of ``model`` (a
    ModelSpec) on ``work`` (a Workload); ``stages``: its blocks per virtual stage, where known."""
    dualpipev = layout.pipeline_schedule == "dualpipev"
    return Job(model=model.facts(), world_size=layout.gpus, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
               virtual_stages=1 if dualpipev else layout.virtual_stages, pipeline_schedule=layout.pipeline_schedule,
               sequence_parallel=layout.sequence_parallel, cp_comm_type=layout.cp_comm_type, seq_length=model.seq,
               zero_stage=layout.zero_stage, precision=work.precision, global_batch=work.global_batch,
               # the planner counts DeepSpeed's bf16 optimizer with fp32 accumulation (the shipped bf16 configs)
               grad_accum_dtype="fp32" if work.precision == "bf16" else None,
               micro_batch=layout.microbatch, moe_overlap_comm=layout.overlap_moe_expert_parallel_comm,
               stage_blocks=None if stages is None else tuple(stages.blocks),
               deepspeed_version=installed_deepspeed())


def default_partition(model, layout, work, capacity_bytes: float):
    """The partition train.py builds without --pipeline-layout (mtds.plan.balance.run_partition)."""
    from mtds.plan.balance import run_partition
    return run_partition(model, layout, work, layout.gpus, None, capacity_bytes)


def rule_problems(model, layout, work, capacity_bytes: float, stages=None) -> list:
    """Every rule train.py would refuse ``layout`` by (:class:`mtds.rules.Problem`), judged at ``stages`` or, where
    a rule weighs the partition, at train.py's default one within ``capacity_bytes`` per GPU."""
    job = job_of(model, layout, work, stages)
    found = rules.problems(job)
    if not found and stages is None and any(rule.applies(job) for rule in rules.PARTITION_RULES):
        job = job_of(model, layout, work, default_partition(model, layout, work, capacity_bytes))
        found = rules.problems(job, rules.PARTITION_RULES)
    return found


def cannot(found: list) -> list[str]:
    """The problems no build of train.py could run (shapes, schedules): the planner's infeasible reasons."""
    return [p.message for p in found if p.kind == rules.CANNOT]
