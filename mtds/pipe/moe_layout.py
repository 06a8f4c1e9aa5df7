"""What this increment of mixture-of-experts does not build yet, refused before a model exists (docs/moe.md):
one error line each, never a silently different model or a wrong gradient."""
from __future__ import annotations

from mtds.model.config import ModelConfig
from mtds.parallel.layout import LayoutError, ParallelLayout


def check_expert_parallel(cfg: ModelConfig, layout: ParallelLayout) -> None:
    """--expert-model-parallel-size against the model, before any process group exists."""
    e = layout.ep
    if e == 1:
        return
    if not cfg.num_experts:
        raise LayoutError(f"--expert-model-parallel-size {e} needs a mixture-of-experts model (Mixtral, Qwen3-MoE); "
                          f"this one has no experts: leave it at 1")
    if cfg.num_experts % e:
        raise LayoutError(f"--expert-model-parallel-size {e} does not divide the model's {cfg.num_experts} experts: "
                          f"choose it from the common divisors of {cfg.num_experts} and the data-parallel size "
                          f"{layout.dp}")


def refuse_unbuilt_expert_parallel(layout: ParallelLayout, precision: str, zero_stage: int,
                                   checkpoints: bool) -> None:
    """What expert parallelism does not build yet (docs/moe.md): its gradient reduction is mtds's own on
    DeepSpeed's fp32 ZeRO-0 path only, and DeepSpeed's checkpoint writer keeps the data-parallel rank 0's
    parameters, i.e. one expert shard of e."""
    if layout.ep == 1:
        return
    e = f"--expert-model-parallel-size {layout.ep}"
    if precision != "fp32" or zero_stage != 0:
        raise LayoutError(f"{e} trains in fp32 with ZeRO-0 for now (asked {precision}, ZeRO-{zero_stage}): the "
                          f"expert gradients' own reduction is not built for DeepSpeed's 16-bit and ZeRO optimizers; "
                          f"use a config like ds_configs/cpu_zero0_fp32.json, or --expert-model-parallel-size 1")
    if checkpoints:
        raise LayoutError(f"{e}: checkpoints of expert-parallel runs are not built yet (each rank holds other "
                          f"experts; DeepSpeed writes data-parallel rank 0's); train without --save/--load, or at "
                          f"--expert-model-parallel-size 1")


def refuse_unbuilt_moe(cfg: ModelConfig, layout: ParallelLayout) -> None:
    if layout.pp > 1:
        # transformers' aux loss pools the expert counts of every MoE block of the forward
        # (mtds.model.aux_loss): on a pipeline those blocks sit on several stages.
        raise LayoutError(f"MoE models train at --pp 1 for now (asked --pp {layout.pp}): the load-balancing loss "
                          f"pools every block's router counts, which are not yet carried across stages")
    if cfg.moe_ffn_size % layout.tp:
        raise LayoutError(f"tensor parallel size {layout.tp} does not divide the expert FFN size "
                          f"{cfg.moe_ffn_size}")
