"""What a rule says about a job: a :class:`Problem` (one line naming the flags and the fix), and the error a
refused job ends with."""
from __future__ import annotations

from dataclasses import dataclass


CANNOT, NOT_BUILT = "cannot", "not built"


@dataclass(frozen=True)
class Problem:
    """One broken rule: ``rule`` its name in the rulebook (:data:`mtds.rules.book.RULES`), ``message`` the one
    line a user reads (the flags involved and what to do), ``kind`` CANNOT (no build of mtds could: a shape
    that does not divide) or NOT_BUILT (mtds, or DeepSpeed under it, does not do it yet)."""

    rule: str
    message: str
    kind: str = CANNOT

    def __str__(self) -> str:
        return self.message


class JobRefused(ValueError):
    """A job the rulebook refuses. Every rank decides it from the same description, so the first rank alone
    reports it (``same_on_every_rank``: mtds.training.distributed.report_error)."""

    same_on_every_rank = True

    def __init__(self, problem: Problem):
        super().__init__(problem.message)
        self.problem = problem
