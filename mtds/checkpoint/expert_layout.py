"""Which layouts a mixture-of-experts checkpoint resumes at (docs/moe.md, "Resharding at E > 1").

At its own layout every checkpoint resumes through DeepSpeed's load (its MoE path at E > 1). Another layout
needs resharding, built (mtds.checkpoint.reshard_experts) between fp32 ZeRO-1/2 runs without a pipeline: any
t, d and E on either side. The rest is refused in one line, before anything is built where the layout alone
decides (mtds.training.job), at the load for the ZeRO stage and precision (an engine's).
"""
from __future__ import annotations

from mtds.parallel.layout import ParallelLayout

FIELDS = ("tp", "pp", "dp", "ep")      # dp: DeepSpeed's data-parallel size, d·c (CheckpointMeta.dp)
BUILT = ("mixture-of-experts checkpoints reshard only between fp32 ZeRO-1/2 runs at --pp 1 (any --tp, "
         "--expert-model-parallel-size and data-parallel size; docs/moe.md)")


def run_layout(layout: ParallelLayout) -> dict:
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp_cp, "ep": layout.ep}


def expert_layout_problem(saved: dict, layout: ParallelLayout, where: str) -> str | None:
    """One line saying why the checkpoint ``where``, saved at ``saved`` ({tp, pp, dp, ep}; ep missing in
    checkpoints from before it was recorded: 1), cannot resume at ``layout``; None when it can or the
    load decides (same layout; neither side expert-parallel; both at p = 1, where it reshards)."""
    theirs, mine = {k: int(saved.get(k, 1)) for k in FIELDS}, run_layout(layout)
    if theirs == mine or theirs["ep"] == mine["ep"] == 1 or _no_pipeline(theirs) and _no_pipeline(mine):
        return None
    return (f"checkpoint {where} was saved at --expert-model-parallel-size {theirs['ep']} ({_text(theirs)}); this "
            f"run is at --expert-model-parallel-size {mine['ep']} ({_text(mine)}): {BUILT}; resume at the same "
            f"layout")


def reshard_problem(meta, layout: ParallelLayout, zero: int, precision: str, where: str) -> str | None:
    """Why the mixture-of-experts checkpoint ``where`` (its CheckpointMeta ``meta``), which this run (``layout``,
    ZeRO stage ``zero``, ``precision``) would have to reshard, cannot be; None when it can."""
    if convertible(meta) and layout.pp == 1 and zero in (1, 2) and precision == "fp32":
        return None
    return (f"checkpoint {where} was saved at --expert-model-parallel-size {meta.ep} ({_text(meta.layout)}) with "
            f"ZeRO-{meta.zero_stage} {meta.precision}; this run is at --expert-model-parallel-size {layout.ep} "
            f"({_text(run_layout(layout))}) with ZeRO-{zero} {precision}: {BUILT}; resume at the same layout and "
            f"ZeRO stage")


def convertible(meta) -> bool:
    """Whether mtds's converter reads the checkpoint: its ZeRO-1/2 fp32 partitions at p = 1."""
    return meta.pp == 1 and meta.zero_stage in (1, 2) and meta.precision == "fp32" and not meta.weights_only


def _no_pipeline(layout: dict) -> bool:
    return layout["pp"] == 1


def _text(layout: dict) -> str:
    return ", ".join(f"{k} {layout[k]}" for k in FIELDS[:3])
