"""Checkpoints of expert-parallel runs resume at the layout that saved them (docs/moe.md): each rank's expert
files and optimizer state belong to its place in (t, p, d, E), and nothing reshards them yet (DeepSpeed's
universal conversion has no pattern for mtds's stacked experts)."""
from __future__ import annotations

from mtds.parallel.layout import ParallelLayout

FIELDS = ("tp", "pp", "dp", "ep")      # dp: DeepSpeed's data-parallel size, d·c (CheckpointMeta.dp)


def run_layout(layout: ParallelLayout) -> dict:
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp_cp, "ep": layout.ep}


def expert_layout_problem(saved: dict, layout: ParallelLayout, where: str) -> str | None:
    """One line saying why the checkpoint ``where``, saved at ``saved`` ({tp, pp, dp, ep}; ep missing in
    checkpoints from before it was recorded: 1), cannot resume at ``layout``; None when it can (same layout,
    or neither side expert-parallel: the other paths decide)."""
    theirs, mine = {k: int(saved.get(k, 1)) for k in FIELDS}, run_layout(layout)
    if theirs == mine or theirs["ep"] == mine["ep"] == 1:
        return None
    return (f"checkpoint {where} was saved at --expert-model-parallel-size {theirs['ep']} ({_text(theirs)}); this "
            f"run is at --expert-model-parallel-size {mine['ep']} ({_text(mine)}): checkpoints of expert-parallel "
            f"runs are not resharded (each rank's files hold its own experts); resume at the same layout")


def _text(layout: dict) -> str:
    return ", ".join(f"{k} {layout[k]}" for k in FIELDS[:3])
