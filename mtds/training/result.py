"""What ``run`` returns."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunResult:
    """What a run returns on every rank (tests compare these across layouts)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    comm: dict = field(default_factory=dict)          # bytes per collective/group, last step
    layout: str = ""
    params: int = 0                                   # trainable parameter elements on this rank (Ψ of its part)
    layers: list[int] = field(default_factory=list)   # global layer indices this rank built (mtds.model.stages)
    final_step: int = 0
    stopped_by: str | None = None                     # SIGTERM / SIGINT when the run stopped early
    stragglers: list = field(default_factory=list)    # --log-straggler: (report step, ranks named) per report
    profile: dict | None = None                       # --profile-step: mtds.observe.step_profile.summarize's summary
