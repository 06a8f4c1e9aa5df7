"""The rank grid against the world and the model: what t, c, p, v, e and sequence parallelism must divide.

The grid's own invariants (the world splits into t·c·p groups, e divides d, virtual stages need a pipeline)
are the frozen layout's (:class:`mtds.parallel.layout.ParallelLayout`): asked here, decided there."""
from __future__ import annotations

from mtds.parallel.layout import LayoutError, ParallelLayout, divisors
from mtds.parallel.pipeline_layout import PipelineLayoutError, parse_layout
from mtds.rules.job import Job


def grid(job: Job) -> str | None:
    """The world splits into t·c·p groups, e divides d, virtual stages need a pipeline."""
    try:
        ParallelLayout.for_world(job.world_size, tp=job.tp, pp=job.pp, vp=job.chunks, cp=job.cp, ep=job.ep)
    except LayoutError as err:
        return str(err)
    return None


def model_shards(job: Job) -> str | None:
    """t divides the attention and key/value heads, the hidden and FFN sizes; every pipeline stage gets a
    block."""
    m, t = job.model, job.tp
    if m.num_heads % t:
        return f"tensor parallel size {t} does not divide the {m.num_heads} attention heads: choose --tp from " \
               f"{divisors(m.num_heads)}"
    if m.kv_heads % t:
        return f"tensor parallel size {t} does not divide the {m.kv_heads} key/value heads: choose --tp from " \
               f"{divisors(m.kv_heads)}"
    if m.hidden_size % t:
        return f"tensor parallel size {t} does not divide hidden size {m.hidden_size}"
    if m.ffn_size % t:
        return f"tensor parallel size {t} does not divide FFN size {m.ffn_size}"
    stages = job.pp * job.chunks
    if m.num_layers < stages:
        return f"{m.num_layers} layers cannot fill pp*vp = {stages} pipeline stages: use --pp <= {m.num_layers}"
    return None


def sequence_parallel(job: Job) -> str | None:
    """Sequence parallelism splits every sequence into t equal slices."""
    if not job.sequence_parallel:
        return None
    if job.tp == 1:
        return "--sequence-parallel needs tensor parallelism (--tp > 1): it splits the sequence over the " \
               "tensor-parallel group"
    if job.seq_length % job.tp:
        return f"--sequence-parallel needs --seq-length divisible by --tp {job.tp}, got {job.seq_length}: use a " \
               f"multiple of {job.tp}"
    return None


def pipeline_layout(job: Job) -> str | None:
    """A --pipeline-layout names p·v stages holding the model's blocks (its parser decides)."""
    if job.pipeline_layout is None:
        return None
    if job.pp == 1:
        return "--pipeline-layout needs a pipeline: set --pp >= 2 (or drop the layout)"
    try:
        parse_layout(job.pipeline_layout, stages=job.pp * job.chunks, num_layers=job.model.num_layers)
    except PipelineLayoutError as err:
        return str(err)
    return None
