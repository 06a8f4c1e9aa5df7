"""Which layouts a mixture-of-experts checkpoint resumes at (docs/moe.md, "Resharding at E > 1").

At its own layout every checkpoint resumes through DeepSpeed's load (its MoE path at E > 1, per pipeline stage
at p > 1). Another layout needs resharding, built (mtds.checkpoint.reshard_experts) between ZeRO-1/2 runs of the same precision, fp32 or
bf16 (DeepSpeed's BF16 optimizer keeps fp32 masters as ZeRO does): any t, p, d and E on either side; and, fp32 only,
from or into ZeRO-0 at p = 1 (its optimizer per EP shard in DeepSpeed's ``expp_rank_J`` files): any t, d and E, to
or from ZeRO-0/1/2. The rest (a ZeRO-0 pipeline, fp16, another precision, bf16 ZeRO-0, a weights-only checkpoint as
training state) is refused in one line at the load, where the engine's ZeRO stage and precision are known.
"""
from __future__ import annotations

from mtds.parallel.layout import ParallelLayout

FIELDS = ("tp", "pp", "dp", "ep")      # dp: DeepSpeed's data-parallel size, d·c (CheckpointMeta.dp)
BUILT = ("mixture-of-experts checkpoints reshard only between ZeRO-1/2 runs of the same precision, fp32 or bf16 "
         "(any --tp, --pp, --expert-model-parallel-size and data-parallel size), and from or into fp32 ZeRO-0 at "
         "--pp 1 (docs/moe.md)")


def run_layout(layout: ParallelLayout) -> dict:
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp_cp, "ep": layout.ep}


def reshard_problem(meta, layout: ParallelLayout, zero: int, precision: str, where: str) -> str | None:
    """Why the mixture-of-experts checkpoint ``where`` (its CheckpointMeta ``meta``), which this run (``layout``,
    ZeRO stage ``zero``, ``precision``) would have to reshard, cannot be; None when it can."""
    if meta.model_config.moe_router_enable_expert_bias:
        # the converter carries parameters and their optimizer states; the routers' bias is a buffer it would drop
        return (f"checkpoint {where} holds DeepSeek-V3's expert biases (e_score_correction_bias, a buffer), which "
                f"resharding does not carry yet: resume at the layout it was saved at (--expert-model-parallel-size "
                f"{meta.ep}, {_text(meta.layout)}, ZeRO-{meta.zero_stage} {meta.precision})")
    if convertible(meta) and precision == meta.precision and (
            zero in (1, 2) or (zero == 0 and precision == "fp32" and layout.pp == 1)):
        return None
    return (f"checkpoint {where} was saved at --expert-model-parallel-size {meta.ep} ({_text(meta.layout)}) with "
            f"ZeRO-{meta.zero_stage} {meta.precision}; this run is at --expert-model-parallel-size {layout.ep} "
            f"({_text(run_layout(layout))}) with ZeRO-{zero} {precision}: {BUILT}; resume at the same layout and "
            f"ZeRO stage")


def convertible(meta) -> bool:
    """Whether mtds's converter reads the checkpoint: the fp32 partitions of its ZeRO-1/2 or BF16 optimizer (each
    pipeline stage's), or an fp32 ZeRO-0 one's whole optimizer per EP shard (p = 1)."""
    if meta.weights_only:
        return False
    if meta.zero_stage == 0:
        return meta.precision == "fp32" and meta.pp == 1
    return meta.zero_stage in (1, 2) and meta.precision in ("fp32", "bf16")


def _text(layout: dict) -> str:
    return ", ".join(f"{k} {layout[k]}" for k in FIELDS[:3])
