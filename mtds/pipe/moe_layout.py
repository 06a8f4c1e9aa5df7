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


def refuse_unbuilt_expert_parallel(layout: ParallelLayout, precision: str, zero_stage: int) -> None:
    """What expert parallelism does not do yet, or not correctly on DeepSpeed's side (docs/moe.md)."""
    if layout.ep == 1:
        return
    e = f"--expert-model-parallel-size {layout.ep}"
    if zero_stage == 3:
        raise LayoutError(f"{e} with ZeRO-3 is not built: ZeRO-3 would partition each rank's own experts as if "
                          f"every data rank held them; use ZeRO-0, 1 or 2")
    if precision != "fp32" and zero_stage == 0:
        # deepspeed/runtime/fp16/unfused_optimizer.py step(): the expert half of
        # split_params_grads_into_shared_and_expert_params is dropped from the norm that clipping uses (p = 1;
        # at p > 1 DeepSpeed's BF16_Optimizer runs instead, not checked with experts)
        raise LayoutError(f"{e} with {precision} needs ZeRO-1 or 2: at ZeRO-0 DeepSpeed's unfused {precision} "
                          f"optimizer leaves the expert gradients out of the global norm it clips by")


def refuse_unbuilt_moe(cfg: ModelConfig, layout: ParallelLayout, *, carry_router_stats: bool = False,
                       one_tensor_boundaries: bool = False, documents: bool = False) -> None:
    """``carry_router_stats``: the model being built carries the router statistics across pipeline stages
    (training, mtds.model.router_carry); ``one_tensor_boundaries``: its engine sends one tensor between stages
    (mtds's interleaved / zero-bubble engine, DeepSpeed's DualPipeV)."""
    if layout.pp > 1:
        # transformers' aux loss pools the expert counts of every MoE block of the forward
        # (mtds.model.aux_loss): on a pipeline they travel with the activations, as a tuple
        if not carry_router_stats:
            raise LayoutError(f"this MoE model is built at --pp 1 only here (asked --pp {layout.pp}): evaluate "
                              f"it at --pp 1")
        if one_tensor_boundaries:
            raise LayoutError(f"MoE models with --pp {layout.pp} need --pipeline-schedule 1f1b: the router "
                              f"statistics travel beside the activation, and this schedule sends one tensor "
                              f"between stages")
        if documents:
            raise LayoutError(f"MoE models with --pp {layout.pp} and packed-document resets (--reset-position-ids, "
                              f"--reset-attention-mask) are not built: both travel beside the activation; use "
                              f"--pp 1 or leave the resets off")
    if cfg.moe_ffn_size % layout.tp:
        raise LayoutError(f"tensor parallel size {layout.tp} does not divide the expert FFN size "
                          f"{cfg.moe_ffn_size}")
