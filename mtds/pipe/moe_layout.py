"""What this increment of mixture-of-experts does not build yet, refused before a model exists (docs/moe.md):
one error line each, never a silently different model or a wrong gradient."""
from __future__ import annotations

from mtds.model.config import ModelConfig
from mtds.parallel.layout import LayoutError, ParallelLayout


def refuse_unbuilt_moe(cfg: ModelConfig, layout: ParallelLayout) -> None:
    if layout.pp > 1:
        # transformers' aux loss pools the expert counts of every MoE block of the forward
        # (mtds.model.aux_loss): on a pipeline those blocks sit on several stages.
        raise LayoutError(f"MoE models train at --pp 1 for now (asked --pp {layout.pp}): the load-balancing loss "
                          f"pools every block's router counts, which are not yet carried across stages")
    if cfg.moe_ffn_size % layout.tp:
        raise LayoutError(f"tensor parallel size {layout.tp} does not divide the expert FFN size "
                          f"{cfg.moe_ffn_size}")
