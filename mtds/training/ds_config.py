"""Read a user's DeepSpeed JSON, check its keys and values, and settle the batch arithmetic.

DeepSpeed owns the semantics (ZeRO, precision, loss scaling, optimizer); this module reads what the rulebook
weighs (stage, precision, batch: mtds.training.admit) and refuses what is wrong in the config itself (a key
DeepSpeed does not read, a value of the wrong kind, an unknown optimizer, fp16 on a machine without it), one
line each, before DeepSpeed fails deep inside its engine; it derives B = micro batch b x accumulation m x d.
"""
from __future__ import annotations

import copy
import json
import numbers
import os
from dataclasses import dataclass
from typing import Any

from mtds.parallel.layout import ParallelLayout
from mtds.rules.deepspeed import batch_problem


class ConfigError(ValueError):
    """A DeepSpeed config that cannot run with this layout or machine."""


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int       # B: samples per optimizer step, all data-parallel ranks together
    micro_batch: int        # b: samples per forward pass per rank
    accumulation: int       # m: micro-batches per step per data-parallel rank (= pipeline micro-batches)


def load_ds_config(source: str | os.PathLike | dict) -> dict[str, Any]:
    """The user's DeepSpeed config (a JSON file or the dict itself), its keys checked against DeepSpeed's
    own parser (:func:`check_keys`) before anything is set up."""
    if isinstance(source, dict):
        config = copy.deepcopy(source)
        check_keys(config, "the DeepSpeed config")
        return config
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise ConfigError(f"DeepSpeed config {path!r} not found: pass --deepspeed_config with a JSON file "
                          f"(see ds_configs/)")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as err:
        raise ConfigError(f"DeepSpeed config {path!r} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"DeepSpeed config {path!r} holds a JSON {type(config).__name__}, not an object of "
                          f"settings (see ds_configs/)")
    check_keys(config, f"the DeepSpeed config {path}")
    return config


def check_keys(config: dict, where: str = "the DeepSpeed config") -> None:
    """Refuse, in one line, the first key DeepSpeed does not read (it would ignore it silently, or refuse it
    only once the engine is built), naming where it sits and the nearest valid key; and a string value
    DeepSpeed reads otherwise than written ("auto", "false", "1"). The schema is DeepSpeed's own:
    mtds.deepspeed_compat.config_schema."""
    import deepspeed

    from mtds.deepspeed_compat.config_schema import find_problems
    problems = find_problems(config)
    if problems:
        raise ConfigError(describe_problem(problems[0], where, deepspeed.__version__))


def describe_problem(problem, where: str, version: str) -> str:
    """One line for a :class:`mtds.deepspeed_compat.config_schema.ConfigProblem`."""
    dotted = ".".join(problem.path)
    if problem.kind == "auto":
        return (f"`{dotted}` in {where} is \"auto\", a placeholder HF's Trainer fills in before DeepSpeed sees "
                f"the config: DeepSpeed {version} alone drops it and uses {json.dumps(problem.converted)}; "
                f"write the value you want")
    if problem.kind == "string":
        value = json.dumps(problem.converted)
        return (f"`{dotted}` in {where} is the string {json.dumps(problem.value)}, which DeepSpeed {version} "
                f"reads as {value}: write {value}, without quotes")
    at = "" if len(problem.path) > 1 else " (at the top level)"
    if problem.suggestion is not None:
        hint = f"did you mean `{'.'.join(problem.suggestion)}`?"
    elif len(problem.valid) <= 12:
        hint = f"the keys DeepSpeed reads there are {', '.join(problem.valid)}"
    else:
        hint = "see https://www.deepspeed.ai/docs/config-json/ for the keys DeepSpeed reads"
    fate = "ignore it silently" if problem.silent else "refuse it only once the data and model are set up"
    return f"unknown key `{dotted}` in {where}{at}: {hint} (DeepSpeed {version} would {fate})"


def override_batch(config: dict, global_batch: int | None = None, micro_batch: int | None = None) -> dict:
    """``config`` with Megatron's --global-batch-size / --micro-batch-size in place of its batch keys; the
    accumulation steps are then derived (a stale ``gradient_accumulation_steps`` is dropped)."""
    for flag, value in (("--global-batch-size", global_batch), ("--micro-batch-size", micro_batch)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be a positive number of sequences, got {value}")
    if global_batch is None and micro_batch is None:
        return config
    config = copy.deepcopy(config)
    config.pop("gradient_accumulation_steps", None)
    if global_batch is not None:
        config["train_batch_size"] = global_batch
    if micro_batch is not None:
        config["train_micro_batch_size_per_gpu"] = micro_batch
    return config


def override_from_flags(config: dict, *, bf16: bool = False, fp16: bool = False, clip_grad: float | None = None,
                        weight_decay: float | None = None) -> tuple[dict, list[str]]:
    """``config`` with Megatron's --bf16 / --fp16 / --clip-grad / --weight-decay in place of its keys, and the
    overrides as the header names them (``--bf16 (bf16.enabled)``)."""
    config, named = copy.deepcopy(config), []
    for flag, on, off in (("--bf16", "bf16", "fp16"), ("--fp16", "fp16", "bf16")):
        if (bf16 if on == "bf16" else fp16):
            config[on] = {**(config.get(on) or {}), "enabled": True}
            config.pop("bfloat16", None)       # DeepSpeed's older spelling of bf16 would shadow the flag
            if off in config:
                config[off] = {**config[off], "enabled": False}
            named.append(f"{flag} ({on}.enabled)")
    if clip_grad is not None:
        config["gradient_clipping"] = clip_grad
        named.append(f"--clip-grad {clip_grad:g} (gradient_clipping)")
    if weight_decay is not None:
        optimizer = config.get("optimizer")
        if not isinstance(optimizer, dict):
            raise ConfigError("--weight-decay sets the DeepSpeed config's optimizer.params.weight_decay, but the "
                              "config has no \"optimizer\" section: add one (see ds_configs/) or drop the flag")
        config["optimizer"] = {**optimizer, "params": {**(optimizer.get("params") or {}), "weight_decay": weight_decay}}
        named.append(f"--weight-decay {weight_decay:g} (optimizer.params.weight_decay)")
    return config, named


def precision(config: dict) -> str:
    if config.get("bf16", {}).get("enabled"):
        return "bf16"
    if config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def zero_stage(config: dict) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def batch_values(config: dict, dp: int) -> tuple[int | None, int, int | None]:
    """(B, b, m) as the config states them: B and m None where it leaves them out, b derived from B / (m d)
    where only those two are given. Each a positive whole number, or one line."""
    B = config.get("train_batch_size")
    b = config.get("train_micro_batch_size_per_gpu")
    m = config.get("gradient_accumulation_steps")
    for key, value in (("train_batch_size", B), ("train_micro_batch_size_per_gpu", b), ("gradient_accumulation_steps", m)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
            hint = (" (\"auto\" is a placeholder HF's Trainer fills in: set a number, or pass --global-batch-size "
                    "/ --micro-batch-size, which replace the config's)" if value == "auto" else "")
            raise ConfigError(f"{key} in the DeepSpeed config must be a positive whole number, got "
                              f"{json.dumps(value)}{hint}")
    if b is None and B is not None and m is not None:
        b = B // (m * dp) if B % (m * dp) == 0 else None
    if b is None:
        raise ConfigError("the DeepSpeed config needs train_micro_batch_size_per_gpu (or train_batch_size "
                          "with gradient_accumulation_steps)")
    return B, b, m


def plan_batch(config: dict, dp: int) -> BatchPlan:
    """Fill in whichever of B, b, m the config leaves out (the rulebook's batch rule holds them together)."""
    B, b, m = batch_values(config, dp)
    problem = batch_problem(B, b, m, dp)
    if problem is not None:
        raise ConfigError(problem)
    if B is None:
        B = b * (m or 1) * dp
    return BatchPlan(global_batch=B, micro_batch=b, accumulation=B // (b * dp))


def check_optimizer(config: dict, lr: float | None) -> None:
    optimizer = config.get("optimizer")
    if optimizer is None:
        return
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("type"), str):
        raise ConfigError('the DeepSpeed config\'s "optimizer" needs a "type" (e.g. "AdamW") and "params"')
    # What DeepSpeed's engine accepts: its own optimizers or a torch.optim class name.
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    if optimizer["type"].lower() not in DEEPSPEED_OPTIMIZERS and getattr(torch.optim, optimizer["type"], None) is None:
        raise ConfigError(f"unknown optimizer type {optimizer['type']!r} in the DeepSpeed config: use one of "
                          f"DeepSpeed's ({', '.join(DEEPSPEED_OPTIMIZERS)}) or a torch.optim class, e.g. AdamW")
    value = lr if lr is not None else optimizer.get("params", {}).get("lr")
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ConfigError(f"learning rate must be a positive number, got {value!r}: fix optimizer.params.lr or --lr")


def prepare_ds_config(config: dict, layout: ParallelLayout, *, device_type: str, lr: float | None = None) -> tuple[dict, BatchPlan]:
    """``config`` for ``layout``, a copy with consistent batch keys, for a job the rulebook admitted
    (mtds.training.admit): what is left to refuse here is the machine's (fp16) and the optimizer's."""
    config = copy.deepcopy(config)
    if precision(config) == "fp16":
        from deepspeed.accelerator import get_accelerator
        if not get_accelerator().is_fp16_supported():
            raise ConfigError(f"fp16 is not supported on this {device_type} device: use a bf16 or fp32 config "
                              f"(e.g. ds_configs/cpu_bf16.json)")

    check_optimizer(config, lr)
    plan = plan_batch(config, layout.dp)
    # DeepSpeed counts a micro-batch per rank of its data axis, which holds the d·c gradient replicas
    # (mtds.parallel.layout): its train_batch_size is c times the sequences of a global batch.
    config["train_batch_size"] = plan.global_batch * layout.cp
    config["train_micro_batch_size_per_gpu"] = plan.micro_batch
    config["gradient_accumulation_steps"] = plan.accumulation

    optimizer = config.get("optimizer")
    if optimizer is not None:
        params = optimizer.setdefault("params", {})
        if lr is not None:
            params["lr"] = lr
        # DeepSpeed's fused Adam is a JIT-compiled CUDA/C++ op; on CPU torch's AdamW is the right tool
        # (and it is what the single-process references use), in its fused CPU kernel: one pass over
        # the flat partition instead of the per-op temporaries (4.5 M parameters: 7.9 -> 2.0 ms a step,
        # one core; the same update up to rounding, ~1e-10 on unit-scale weights).
        # On CUDA a config that asks for torch's AdamW gets its fused kernel too: one launch per dtype
        # group instead of foreach's, and no host read of each group's step count (the suite's CUDA mode
        # counted 7 host reads a step with foreach, 5 fused: tests/test_overhead_counts.py).
        if optimizer.get("type", "").lower() in ("adam", "adamw"):
            if device_type == "cpu":
                params.setdefault("torch_adam", True)
            if params.get("torch_adam") and "foreach" not in params:
                params.setdefault("fused", True)
    config.setdefault("steps_per_print", 10 ** 9)  # we log every step ourselves
    config.setdefault("wall_clock_breakdown", False)
    return config, plan
