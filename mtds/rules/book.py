"""The rulebook: every rule a job's combination of layout, model, schedule, DeepSpeed config and features
must keep, in the order train.py reports them (the first broken one is the job's one ``error:`` line).

train.py's start-up asks all of them once, before anything is built (mtds.training.admit); mtds-eval asks
them for its layout; the planner asks them for every candidate (mtds.plan.runnable): a layout the planner
calls runnable is one train.py starts. Each rule is a torch-free function of a :class:`~mtds.rules.job.Job`
returning its one line, or None. Checks of a single flag's value stay with the flag (mtds.training.options),
the syntax of a file with its reader, and the kernels' checks of their own inputs with the kernels.

``python -m mtds.rules`` prints the table docs/bad_input.md holds (a test keeps them equal)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mtds.rules import checkpoint, context, deepspeed, experts, layout, schedule
from mtds.rules.job import Job, ModelFacts
from mtds.rules.problem import CANNOT, NOT_BUILT, JobRefused, Problem


@dataclass(frozen=True)
class Rule:
    name: str
    check: Callable[[Job], "str | None"]
    flags: str                 # what the rule weighs, as a user spells it
    what: str                  # what it refuses, for the docs' table
    kind: str = CANNOT         # CANNOT | NOT_BUILT (mtds.rules.problem)
    applies: Callable[[Job], bool] = lambda job: True    # False: the rule has nothing to say of this job

    def problem(self, job: Job) -> Problem | None:
        message = self.check(job)
        return None if message is None else Problem(self.name, message, self.kind)


RULES: tuple[Rule, ...] = (
    Rule("schedule-known", schedule.schedule_known, "--pipeline-schedule", "a schedule mtds does not have"),
    Rule("schedule-chunks", schedule.schedule_chunks, "--pipeline-schedule, --pp, --virtual-stages",
         "a schedule without a pipeline, or with chunks per rank it does not run"),
    Rule("compile-schedule", schedule.compile_schedule, "--compile, --pipeline-schedule zb-h1",
         "torch.compile of layers whose backward defers the weight gradients", kind=NOT_BUILT),
    Rule("grid", layout.grid, "world size, --tp, --cp, --pp, --expert-model-parallel-size",
         "a world that does not split into t·c·p groups; e not dividing d·c; virtual stages without a pipeline"),
    Rule("router-flags", experts.router_flags, "--moe-z-loss-coeff, --moe-expert-capacity-factor, "
         "--moe-router-enable-expert-bias, the model",
         "Megatron-core's router options on a model without experts (the bias update: without an expert bias)"),
    Rule("seq-aux-loss", experts.seq_aux_loss,
         "--moe-router-load-balancing-type, --moe-aux-loss-coeff, --pp, the model",
         "Megatron-core's seq_aux_loss without experts or on a pipeline; its weight without it"),
    Rule("model-shards", layout.model_shards, "--tp, --pp, the model",
         "t not dividing the heads, KV heads, hidden or FFN size; fewer blocks than pipeline stages"),
    Rule("experts-split", experts.experts_split, "--expert-model-parallel-size, the model",
         "expert parallelism on a dense model, or e not dividing the experts"),
    Rule("sequence-parallel", layout.sequence_parallel, "--sequence-parallel, --tp, --seq-length",
         "sequence parallelism without TP, or a sequence t does not divide"),
    Rule("cp-shapes", context.cp_shapes, "--context-parallel-size, --seq-length, --sequence-parallel, "
         "--cp-comm-type, --tp", "a sequence not cut into 2c chunks (and t slices with SP); Ulysses' heads not "
         "split over c"),
    Rule("cp-features", context.cp_features, "--context-parallel-size, dropout, --reset-position-ids, "
         "sliding windows, experts with --moe-expert-capacity-factor or in mtds-eval",
         "what context parallelism does not build yet", kind=NOT_BUILT),
    Rule("pipeline-layout", layout.pipeline_layout, "--pipeline-layout, --pp, --virtual-stages, the model",
         "a layout without a pipeline, or whose stages or blocks are not the run's"),
    Rule("zero-stage", deepspeed.zero_stage_known, "zero_optimization.stage", "a ZeRO stage outside 0-3"),
    Rule("zero-pipeline", deepspeed.zero_with_pipeline, "zero_optimization.stage, --pp",
         "ZeRO-2/3 on a pipeline in 16 bits, with experts, overlap_comm or offloading",
         kind=NOT_BUILT),
    Rule("one-precision", deepspeed.one_precision, "fp16.enabled, bf16.enabled", "fp16 and bf16 both on"),
    Rule("batch", deepspeed.batch_splits, "--global-batch-size / train_batch_size, --micro-batch-size, "
         "gradient_accumulation_steps, d", "a global batch that is not micro batch x accumulation x d"),
    Rule("micro-batches", schedule.micro_batch_count, "--pipeline-schedule, --pp, the micro-batches per step",
         "fewer than 2p micro-batches under dualpipev; a count the interleaved order cannot group"),
    Rule("weight-pass-hooks", schedule.weight_pass_hooks,
         "--pipeline-schedule zb-h1, bf16.immediate_grad_update, zero_optimization.overlap_comm",
         "DeepSpeed modes whose per-parameter hooks never see ZB-H1's deferred weight gradients", kind=NOT_BUILT),
    Rule("deepspeed-range", schedule.deepspeed_range, "--pipeline-schedule, the installed DeepSpeed",
         "mtds's own engines and DualPipeV outside the DeepSpeed range they are built on", kind=NOT_BUILT),
    Rule("expert-parallel-zero", experts.expert_parallel_zero, "--expert-model-parallel-size, ZeRO stage, "
         "precision", "expert parallelism with ZeRO-3, or in 16 bits at ZeRO-0", kind=NOT_BUILT),
    Rule("overlap-comm", experts.overlap_comm, "--overlap-moe-expert-parallel-comm, --expert-model-parallel-size, "
         "--sequence-parallel, the model", "the dispatch's overlap without an all-to-all or a shared expert "
         "(with sequence parallelism: not built)"),
    Rule("dualpipev-overlap", experts.dualpipev_overlap, "--overlap-moe-expert-parallel-comm, "
         "--pipeline-schedule dualpipev, --tp, --context-parallel-size, --recompute, dropout, ZeRO stage, precision",
         "DualPipeV's cross-chunk overlap with TP/CP, recompute, dropout, ZeRO-2/3 or 16 bits", kind=NOT_BUILT),
    Rule("expert-width", experts.expert_width, "--tp, the model's expert width", "t not dividing the expert (or shared expert) FFN size"),
    Rule("async-save-needs-save", checkpoint.async_save_needs_save, "--async-save, --save",
         "a background save with no checkpoint directory"),
)

# Rules of the stage partition (blocks per virtual stage), which start-up settles once the rules above hold: the
# cost balancer needs a valid layout and batch (mtds.training.stage_plan).
PARTITION_RULES: tuple[Rule, ...] = ()     # none now: any stage partition runs (MoE: docs/moe.md)
ALL_RULES = RULES + PARTITION_RULES


def problems(job: Job, rules: tuple[Rule, ...] | None = None) -> list[Problem]:
    """Every rule ``job`` breaks, in the rulebook's order (``rules``: these only; default all)."""
    out = []
    for rule in ALL_RULES if rules is None else rules:
        problem = rule.problem(job)
        if problem is not None:
            out.append(problem)
    return out


def check(job: Job, rules: tuple[Rule, ...] | None = None) -> None:
    """Raise :class:`JobRefused` with the first of ``rules`` (default: :data:`RULES`, all but the partition's)
    that ``job`` breaks."""
    for rule in RULES if rules is None else rules:
        problem = rule.problem(job)
        if problem is not None:
            raise JobRefused(problem)


def only(*names: str) -> tuple[Rule, ...]:
    """The rules of these names, in the rulebook's order (a converter asks the layout's shape rules alone)."""
    unknown = set(names) - {rule.name for rule in ALL_RULES}
    if unknown:
        raise KeyError(f"no rule named {sorted(unknown)} in the rulebook")
    return tuple(rule for rule in ALL_RULES if rule.name in names)


def check_shards(model: ModelFacts, *, tp: int, pp: int) -> None:
    """Weights cut for (tp, pp) (the converters' checkpoints): the grid and the model's shard rules."""
    check(Job(model=model, world_size=tp * pp, tp=tp, pp=pp), only("grid", "model-shards", "expert-width"))


def markdown_table() -> str:
    """The rulebook as docs/bad_input.md's table."""
    rows = ["| rule | weighs | refuses | kind |", "|---|---|---|---|"]
    rows += [f"| `{rule.name}` | {rule.flags} | {rule.what} | {rule.kind} |" for rule in ALL_RULES]
    return "\n".join(rows)
