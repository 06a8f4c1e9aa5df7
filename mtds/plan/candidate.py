"""One candidate training set-up (a layout plus batch, ZeRO and recompute): the knobs the planner chooses, and
the workload it runs."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mtds.parallel.layout import ParallelLayout



@dataclass(frozen=True)
class Workload:
    """What is trained: global batch B (sequences per step), precision, tokens to train on."""

    global_batch: int
    precision: str = "bf16"          # bf16 | fp16 | fp32
    train_tokens: float = 300e9      # T in "days to train on T tokens" (PTD-P Table 2 uses 300B)

    @property
    def bytes_per_value(self) -> int:
        return 4 if self.precision == "fp32" else 2


@dataclass(frozen=True)
class Candidate:
    """One training set-up the planner weighs: a layout of t-way tensor, c-way context, p-way pipeline (v model
    chunks per rank, run by a pipeline schedule) and d-way data parallelism -- the trainer's own
    :class:`~mtds.parallel.layout.ParallelLayout`, :attr:`grid` -- plus microbatch b, ZeRO stage, activation
    recomputation and sequence parallelism.

    ``pipeline_schedule`` left empty means "interleaved" when v > 1, else "1f1b"; dualpipev has v = 2
    (two chunks per rank, V placement).

    Context parallelism (``cp`` = c, docs/long_context.md): world = t·c·p·d; the c ranks of a group split
    every sequence, so gradients are summed and ZeRO partitions over d·c ranks (:attr:`dp_cp`), while the
    global batch counts d only: B = b · m · d. ``cp_comm_type``: "p2p" (ring) or "a2a" (Ulysses).

    Expert parallelism (``ep`` = e, docs/moe.md): the experts of an MoE model split over e of the d data ranks
    (consecutive data ranks form a group); e divides d and the number of experts. It adds no ranks."""

    tp: int
    pp: int
    dp: int
    microbatch: int
    virtual_stages: int = 1
    zero_stage: int = 0
    recompute: str = "full"
    sequence_parallel: bool = False
    pipeline_schedule: str = ""
    cp: int = 1
    cp_comm_type: str = "p2p"
    ep: int = 1
    zero2_pipeline_reduce: str = "micro-batch"     # ZeRO-2 at p > 1: "micro-batch" | "step" (docs/training.md)
    zero3_pipeline_gather: str = "step"            # ZeRO-3 at p > 1: "step" | "micro-batch" (docs/training.md)
    # each of the t ranks sends its 1/t of a pipeline message, gathered on the other side (PTD-P Section 4.1), as
    # mtds does; False: every rank sends the whole activation (Megatron-core without sequence parallelism)
    pipeline_scatter_gather: bool = True
    # --overlap-moe-expert-parallel-comm: under DualPipeV one chunk's all-to-alls run under the other's compute
    overlap_moe_expert_parallel_comm: bool = False

    def __post_init__(self):
        if not self.pipeline_schedule:
            object.__setattr__(self, "pipeline_schedule", "interleaved" if self.virtual_stages > 1 else "1f1b")

    @classmethod
    def of_layout(cls, layout, *, microbatch: int, **knobs) -> "Candidate":
        """The candidate a running job is: its :class:`~mtds.parallel.layout.ParallelLayout` plus the knobs."""
        return cls(tp=layout.tp, pp=layout.pp, dp=layout.dp, microbatch=microbatch, virtual_stages=layout.vp,
                   cp=layout.cp, ep=layout.ep, **knobs)

    @property
    def grid(self) -> "ParallelLayout":
        """The rank grid as the trainer builds it (validated there: a grid it refuses raises LayoutError)."""
        from mtds.parallel.layout import ParallelLayout
        return ParallelLayout(tp=self.tp, pp=self.pp, dp=self.dp, vp=self.virtual_stages, cp=self.cp,
                              ep=self.ep)

    @property
    def gpus(self) -> int:
        """World size t·c·p·d."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same parameters (stride t): they sum gradients and share ZeRO partitions, d·c."""
        return self.dp * self.cp

    def local_seq(self, seq: int) -> float:
        """Tokens of one sequence on one rank: s / c (an int where c divides s, as s itself at c = 1)."""
        return seq // self.cp if seq % self.cp == 0 else seq / self.cp

    def microbatches(self, global_batch: int) -> int:
        """m = B / (b d): microbatches each pipeline runs per step (gradient accumulation; the c ranks of a
        context-parallel group run the same micro-batches, so c does not divide B)."""
        return global_batch // (self.microbatch * self.dp)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def zero2_per_micro_batch(self) -> bool:
        """ZeRO-2/3 on a pipeline reducing every micro-batch into the partition (mtds.deepspeed_compat.zero2_reduce;
        ZeRO-3's micro-batch gather mode reduces so)."""
        if self.pp == 1:
            return False
        return (self.zero_stage == 2 and self.zero2_pipeline_reduce == "micro-batch") or \
            (self.zero_stage == 3 and self.zero3_pipeline_gather == "micro-batch")

    @property
    def zero3_pipeline_gathers(self) -> int:
        """ZeRO-3 on a pipeline: parameter all-gathers of the whole stage per step and micro-batch count m --
        returned per micro-batch as a multiplier: 2 x chunks per rank in the micro-batch mode (one per forward
        and per backward pass), 0 in the step mode (one per step; see predict)."""
        if self.zero_stage != 3 or self.pp == 1 or self.zero3_pipeline_gather != "micro-batch":
            return 0
        return 2 * (2 if self.pipeline_schedule == "dualpipev" else self.virtual_stages)

    @property
    def whole_gradients(self) -> bool:
        """Whether each rank keeps its stage's whole gradient through the step: ZeRO 0-1, and ZeRO-2/3 on a pipeline
        in their step modes (ZeRO-1's reduction)."""
        return self.zero_stage < 2 or (self.pp > 1 and not self.zero2_per_micro_batch)

    def short(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        sched = f" {self.pipeline_schedule}" if self.pp > 1 else ""
        cp = f" c{self.cp}/{self.cp_comm_type}" if self.cp > 1 else ""
        ep = f" e{self.ep}" if self.ep > 1 else ""
        return (f"t{self.tp}{cp} p{self.pp} d{self.dp}{ep} b{self.microbatch} v{self.virtual_stages} "
                f"z{self.zero_stage}{'/step' if self.zero_stage in (2, 3) and self.pp > 1 and self.whole_gradients else ''} "
                f"{self.recompute}{sp}{sched}")
