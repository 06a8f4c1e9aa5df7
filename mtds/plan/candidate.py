"""One candidate training layout: the knobs the planner chooses, and the workload it runs."""
from __future__ import annotations

from dataclasses import asdict, dataclass

RECOMPUTE_CHOICES = ("none", "selective", "full")


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
class Layout:
    """t-way tensor, p-way pipeline (v virtual stages per rank), d-way data parallel,
    microbatch b, ZeRO stage, activation recomputation and sequence parallelism."""

    tp: int
    pp: int
    dp: int
    microbatch: int
    virtual_stages: int = 1
    zero_stage: int = 0
    recompute: str = "full"
    sequence_parallel: bool = False

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
        return (f"t{self.tp} p{self.pp} d{self.dp} b{self.microbatch} v{self.virtual_stages} "
                f"z{self.zero_stage} {self.recompute}{sp}")
