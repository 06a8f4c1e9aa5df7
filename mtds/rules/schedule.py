"""What each pipeline schedule needs of the layout, the micro-batch count, the DeepSpeed config and the
features that travel between stages.

``1f1b`` is DeepSpeed's PipelineEngine, ``dualpipev`` its DualPipeVEngine (two chunks per rank, V placement);
``interleaved`` and ``zb-h1`` run on mtds's engine (mtds.pipe.engine), built on DeepSpeed internals of the
tested range only. Every engine carries tensors beside the activation (document ids, router statistics)."""
from __future__ import annotations

from mtds.deepspeed_compat.capabilities import TESTED_SPEC, in_tested_range
from mtds.parallel.choices import OWN_ENGINE, PIPELINE_SCHEDULES
from mtds.rules.job import Job


def interleaved_supports(p: int, m: int) -> bool:
    """m >= p micro-batches in m // p equal groups (each of at least p): the counts mtds's interleaved order
    runs at the (p - 1)/(v m) bubble (mtds.pipe.schedules)."""
    return m >= p and m % (m // p) == 0


def micro_batches_fix(m: int, samples_per_micro_batch: int | None) -> str:
    """How a user gets ``m`` micro-batches per step, in flags: m = --global-batch-size / (--micro-batch-size x d)."""
    if samples_per_micro_batch:
        return f"use --global-batch-size {m * samples_per_micro_batch}, which makes the micro-batches per step {m}"
    return f"set the micro-batches per step (--global-batch-size / (--micro-batch-size x data parallel)) to {m}"


def name_problem(name: str) -> str | None:
    if name not in PIPELINE_SCHEDULES:
        return f"unknown --pipeline-schedule {name!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}"
    return None


def schedule_known(job: Job) -> str | None:
    return name_problem(job.pipeline_schedule)


def chunks_problem(name: str, pp: int, v: int) -> str | None:
    """Chunks per rank (``v``: --virtual-stages) and pipeline size each schedule runs (mtds.pipe.schedules asks
    this of the orders it builds too)."""
    if name == "1f1b":
        if v != 1:
            return f"--virtual-stages {v} needs --pipeline-schedule interleaved (1f1b runs one chunk per rank)"
        return None
    if pp < 2:
        return f"--pipeline-schedule {name} needs a pipeline: set --pp >= 2"
    if name == "dualpipev" and v != 1:
        return "--pipeline-schedule dualpipev places two chunks per rank itself: leave --virtual-stages at 1"
    if name == "zb-h1" and v != 1:
        return f"--pipeline-schedule zb-h1 runs one chunk per rank: leave --virtual-stages at 1 (or use " \
               f"--pipeline-schedule interleaved for V={v})"
    if name == "interleaved" and v < 2:
        return "--pipeline-schedule interleaved needs --virtual-stages >= 2 (v=1 is --pipeline-schedule 1f1b)"
    return None


def schedule_chunks(job: Job) -> str | None:
    return chunks_problem(job.pipeline_schedule, job.pp, job.virtual_stages)


def micro_batches_problem(name: str, p: int, m: int, samples_per_micro_batch: int | None = None) -> str | None:
    """DualPipeV needs 2p micro-batches; the interleaved order splits them into equal groups of at least p
    (mtds.pipe.schedules asks this of the orders it builds too). ``samples_per_micro_batch`` (b·d) lets the fix
    name a --global-batch-size."""
    if name == "dualpipev" and m < 2 * p:
        return f"dualpipev needs at least 2 x pp = {2 * p} micro-batches per step, got {m}: " \
               f"{micro_batches_fix(2 * p, samples_per_micro_batch)}"
    if name == "interleaved" and not interleaved_supports(p, m):
        nxt = next(k for k in range(max(m, p), 2 * max(m, p) + 1) if interleaved_supports(p, k))
        return f"interleaved schedule cannot split {m} micro-batches into equal groups of at least the pipeline " \
               f"size ({p}); {micro_batches_fix(nxt, samples_per_micro_batch)}"
    return None


def micro_batch_count(job: Job) -> str | None:
    m = job.micro_batches
    if m is None or job.pp < 2:
        return None
    return micro_batches_problem(job.pipeline_schedule, job.pp, m, job.micro_batch * job.dp)


def weight_pass_problem(*, bf16_immediate: bool, overlap_comm: bool) -> str | None:
    """ZB-H1's W writes weight gradients into ``param.grad`` after autograd is done with them, so the
    per-parameter gradient hooks of these two DeepSpeed modes would never see them (the engine asks this of
    its own state too: mtds.pipe.engine)."""
    if bf16_immediate:
        return "--pipeline-schedule zb-h1 cannot use bf16.immediate_grad_update (its per-parameter hooks never " \
               "see the deferred weight gradients): set it to false"
    if overlap_comm:
        return "--pipeline-schedule zb-h1 cannot use zero_optimization.overlap_comm (its per-parameter hooks " \
               "never see the deferred weight gradients): set it to false"
    return None


def weight_pass_hooks(job: Job) -> str | None:
    if job.pipeline_schedule != "zb-h1" or job.pp < 2:
        return None
    return weight_pass_problem(bf16_immediate=job.bf16_immediate_grad_update, overlap_comm=job.zero_overlap_comm)


def deepspeed_range(job: Job) -> str | None:
    """mtds's own engines and DualPipeV rest on DeepSpeed internals of the tested range."""
    if job.pp < 2 or job.pipeline_schedule not in (*OWN_ENGINE, "dualpipev") or job.deepspeed_version is None:
        return None
    if in_tested_range(job.deepspeed_version):
        return None
    return f"DeepSpeed {job.deepspeed_version} is outside the range mtds's pipeline schedules are built on " \
           f"({TESTED_SPEC}); use --pipeline-schedule 1f1b or pip install '{TESTED_SPEC}'"


def compile_schedule(job: Job) -> str | None:
    """AOTAutograd traces a layer's backward when it compiles the forward; ZB-H1's backward queues its weight
    GEMMs for the W pass, which Dynamo cannot trace (every layer fell back to eager)."""
    if job.compile and job.pipeline_schedule == "zb-h1" and job.pp > 1:
        return "--compile cannot compile the layers of --pipeline-schedule zb-h1 (its backward defers the weight " \
               "gradients to the W pass): drop --compile or use 1f1b, interleaved or dualpipev"
    return None
