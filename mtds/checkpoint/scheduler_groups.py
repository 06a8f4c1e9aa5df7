"""The LR scheduler's state of a checkpoint saved with another number of optimizer param groups.

DeepSpeed's MoE runs (E > 1) hold two param groups (dense, experts), E = 1 runs one; a torch scheduler keeps one
entry per group (``base_lrs``, ``_last_lr``, ``lr_lambdas``) and fails to step after loading another count
("zip() argument 2 is shorter"). mtds schedules every group alike, so the entries are equal and one stands for
all; unequal entries are refused rather than guessed (docs/moe.md, "Resharding at E > 1").
"""
from __future__ import annotations

import contextlib

from mtds.checkpoint.errors import CheckpointFormatError


def fit_groups(state: dict, groups: int) -> dict:
    """``state`` with every per-group list resized to ``groups`` entries (equal entries only)."""
    saved = len(state.get("base_lrs", ()))
    if saved in (0, groups):
        return state
    out = dict(state)
    for key, value in state.items():
        if isinstance(value, list) and len(value) == saved:
            if any(v != value[0] for v in value):
                raise CheckpointFormatError(f"the checkpoint's LR schedule differs between its {saved} param groups "
                                            f"({key}: {value}): it cannot be resumed with {groups}")
            out[key] = [value[0]] * groups
    return out


@contextlib.contextmanager
def scheduler_fits_groups(engine):
    """Inside, the engine's LR scheduler takes a state saved with another number of param groups."""
    scheduler = engine.lr_scheduler
    if scheduler is None or not hasattr(scheduler, "optimizer"):
        yield
        return
    load = scheduler.load_state_dict
    scheduler.load_state_dict = lambda state: load(fit_groups(state, len(scheduler.optimizer.param_groups)))
    try:
        yield
    finally:
        del scheduler.load_state_dict       # the class's method again
