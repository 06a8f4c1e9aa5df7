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
    """One training set-up the planner weighs: a layout of t-way tensor, p-way pipeline (v model chunks per
    rank, run by a pipeline schedule) and d-way data parallelism -- the trainer's own
    :class:`~mtds.parallel.layout.ParallelLayout`, :attr:`grid` -- plus microbatch b, ZeRO stage, activation
    recomputation and sequence parallelism.

    ``pipeline_schedule`` left empty means "interleaved" when v > 1, else "1f1b"; dualpipev has v = 2
    (two chunks per rank, V placement)."""

    tp: int
    pp: int
    dp: int
    microbatch: int
    virtual_stages: int = 1
    zero_stage: int = 0
    recompute: str = "full"
    sequence_parallel: bool = False
    pipeline_schedule: str = ""

    def __post_init__(self):
        if not self.pipeline_schedule:
            object.__setattr__(self, "pipeline_schedule", "interleaved" if self.virtual_stages > 1 else "1f1b")

    @classmethod
    def of_layout(cls, layout, *, microbatch: int, **knobs) -> "Candidate":
        """The candidate a running job is: its :class:`~mtds.parallel.layout.ParallelLayout` plus the knobs."""
        return cls(tp=layout.tp, pp=layout.pp, dp=layout.dp, microbatch=microbatch, virtual_stages=layout.vp,
                   **knobs)

    @property
    def grid(self) -> "ParallelLayout":
        """The rank grid as the trainer builds it (validated there: a grid it refuses raises LayoutError)."""
        from mtds.parallel.layout import ParallelLayout
        return ParallelLayout(tp=self.tp, pp=self.pp, dp=self.dp, vp=self.virtual_stages)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def microbatches(self, global_batch: int) -> int:
        """m = B / (b d): microbatches each pipeline runs per step (gradient accumulation)."""
        return global_batch // (self.microbatch * self.dp)

    def as_dict(self) -> dict:
        return asdict(self)

    def short(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        sched = f" {self.pipeline_schedule}" if self.pp > 1 else ""
        return (f"t{self.tp} p{self.pp} d{self.dp} b{self.microbatch} v{self.virtual_stages} "
                f"z{self.zero_stage} {self.recompute}{sp}{sched}")
