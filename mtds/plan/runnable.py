"""What train.py can run today: the one list the planner checks before it recommends a layout.

When the trainer gains a feature, flip its flag here (one line) and the planner starts recommending
it. Layouts using a feature marked False are left out of `mtds-plan`'s ranking (``plan(...,
runnable_only=True)``, the default) or, when asked for (``--include-unrunnable``, or evaluating such a
layout), shown with the reason.
"""
from __future__ import annotations

from mtds.parallel.choices import PIPELINE_SCHEDULES, RECOMPUTE_MODES

# The trainer runs every word of the shared vocabulary (mtds.parallel.choices); a feature that exists in the
# vocabulary before train.py can run it is set False here.
TRAIN_PY_RUNS = {
    "pipeline_schedule": {name: True for name in PIPELINE_SCHEDULES},
    "recompute": {mode: True for mode in RECOMPUTE_MODES},
}


# Schedules train.py would run in fp32 only. None today: zb-h1's W hands its gradients to DeepSpeed's
# bf16/fp16 accumulation as a backward does (mtds.pipe.engine), bit-identical to 1f1b in tests.
FP32_ONLY_SCHEDULES: tuple[str, ...] = ()


def not_runnable(layout, precision: str | None = None, moe: bool = False) -> list[str]:
    """Why train.py cannot run ``layout`` (empty list: it can) at ``precision`` (None: not checked); ``moe``: the
    model has experts (mtds.pipe.moe_layout's refusals, docs/moe.md)."""
    out = []
    if moe and layout.pp > 1 and layout.pipeline_schedule != "1f1b":
        # the router statistics travel beside the activation (mtds.model.router_carry): DeepSpeed's 1F1B only
        out.append(f"train.py trains MoE models on a pipeline with the 1f1b schedule only, not "
                   f"{layout.pipeline_schedule}")
    if getattr(layout, "ep", 1) > 1 and layout.zero_stage == 3:
        out.append(f"train.py runs expert parallelism (--ep {layout.ep}) with ZeRO-0, 1 or 2, not ZeRO-3")
    elif getattr(layout, "ep", 1) > 1 and layout.zero_stage == 0 and precision not in (None, "fp32"):
        # DeepSpeed's unfused 16-bit optimizer leaves expert gradients out of its norm (mtds.pipe.moe_layout)
        out.append(f"train.py runs expert parallelism (--ep {layout.ep}) in {precision} with ZeRO-1 or 2, not ZeRO-0")
    schedule = layout.pipeline_schedule if layout.pp > 1 else "1f1b"
    if not TRAIN_PY_RUNS["pipeline_schedule"].get(schedule, False):
        out.append(f"train.py cannot run --pipeline-schedule {schedule} yet")
    elif schedule in FP32_ONLY_SCHEDULES and precision not in (None, "fp32"):
        out.append(f"train.py runs --pipeline-schedule {schedule} in fp32 only, not {precision}")
    if not TRAIN_PY_RUNS["recompute"].get(layout.recompute, False):
        out.append(f"train.py cannot run {layout.recompute} recomputation yet")
    return out
