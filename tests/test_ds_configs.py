"""What each shipped DeepSpeed config resolves to. The GPU configs must not make DeepSpeed JIT-build its
FusedAdam (it needs nvcc, absent from runtime-only images): Adam/AdamW go to torch's implementation
(``torch_adam``), fused (``fused``, passed through by DeepSpeed to ``torch.optim.AdamW``)."""
from __future__ import annotations

import glob
import os

import pytest

from lab.testing import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json")))
GPU = [c for c in CONFIGS if not os.path.basename(c).startswith("cpu_")]


def _prepared(path: str, device_type: str) -> dict:
    from mtds.parallel.layout import ParallelLayout
    from mtds.training.ds_config import load_ds_config, prepare_ds_config
    config = load_ds_config(path)
    config.pop("fp16", None)      # refused on this CPU whatever the device named; the optimizer does not depend on it
    layout = ParallelLayout.for_world(8, tp=2, pp=2 if "zero3" not in path else 1, vp=1)
    return prepare_ds_config(config, layout, device_type=device_type)[0]


def test_every_config_is_found():
    names = {os.path.basename(c) for c in CONFIGS}
    assert {"ptdp_bf16.json", "ptdp_fp16.json", "ptdp_fp32.json", "zero3_bf16.json", "zero3_fp16.json",
            "zero3_fp32.json", "cpu_fp32.json"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_adam_resolves_to_torch_never_a_jit_build(path, device_type):
    optimizer = _prepared(path, device_type)["optimizer"]
    assert optimizer["type"].lower() in ("adam", "adamw")
    assert optimizer["params"].get("torch_adam") is True, \
        f"{os.path.basename(path)} on {device_type}: DeepSpeed would build its FusedAdam op"
    if device_type == "cpu" or os.path.basename(path) in {os.path.basename(g) for g in GPU}:
        # on CPU mtds asks for torch's fused kernel itself (one pass, no per-op temporaries)
        assert optimizer["params"].get("fused") is True, f"{os.path.basename(path)}: torch's fused AdamW"


def _engine_optimizers(paths):
    """Build a real DeepSpeed engine from each config (CPU-adapted batch, bf16/fp32) on one rank; the
    torch optimizer DeepSpeed made and its ``fused`` flag."""
    import deepspeed
    import torch
    from torch import nn

    from mtds.training.distributed import init_distributed
    # as mtds starts DeepSpeed: without it, DeepSpeed's comm start JIT-builds an inference-only op (~20 s)
    init_distributed()
    found = []
    for path in paths:
        config = _prepared(path, "cpu")
        config.update(train_batch_size=2, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        inner = engine.optimizer
        while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
            inner = inner.optimizer
        found.append((type(inner).__module__ + "." + type(inner).__name__, inner.defaults.get("fused")))
        engine.destroy()
    return found


def test_configs_build_torch_fused_adamw_in_deepspeed():
    paths = [p for p in CONFIGS if "fp16" not in p]     # fp16 needs a GPU; same optimizer block
    found = spawn(_engine_optimizers, 1, paths)[0]
    for path, (cls, fused) in zip(paths, found):
        assert cls == "torch.optim.adamw.AdamW" and fused is True, (os.path.basename(path), cls, fused)


def test_torch_adamw_is_fused_on_cuda_unless_the_config_says_otherwise():
    """A config that asks for torch's AdamW (``torch_adam``) gets the fused kernel on CUDA as on CPU (the
    suite's CUDA mode on an H100 counted 7 host reads a step with torch's foreach default, 5 fused); on
    CUDA a plain Adam config keeps DeepSpeed's own FusedAdam, and an explicit ``foreach`` or ``fused`` wins."""
    from mtds.parallel.layout import ParallelLayout
    from mtds.training.ds_config import prepare_ds_config
    layout = ParallelLayout.for_world(1, tp=1, pp=1, vp=1)

    def params(extra):
        config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **extra}}}
        return prepare_ds_config(config, layout, device_type="cuda")[0]["optimizer"]["params"]

    assert params({"torch_adam": True})["fused"] is True
    assert "fused" not in params({"torch_adam": True, "foreach": True})
    assert params({"torch_adam": True, "fused": False})["fused"] is False
    assert "fused" not in params({}) and "torch_adam" not in params({})     # DeepSpeed's FusedAdam on GPUs


def test_megatron_batch_flags_override_the_config():
    """--global-batch-size / --micro-batch-size (Megatron's names) replace the JSON's batch keys; accumulation
    is derived again (the JSON's stale gradient_accumulation_steps dropped). The GPU configs' B = 512 needs
    more than the shipped corpus holds (seen on an H100): these flags are how a run asks for less."""
    from mtds.parallel.layout import ParallelLayout
    from mtds.training.cli import build_parser, config_from_args
    from mtds.training.ds_config import load_ds_config, override_batch, prepare_ds_config
    gpu = load_ds_config(os.path.join(ROOT, "ds_configs", "ptdp_bf16.json"))
    gpu["gradient_accumulation_steps"] = 512
    layout = ParallelLayout.for_world(2, tp=1, pp=1, vp=1)
    plan = prepare_ds_config(override_batch(gpu, 64, 8), layout, device_type="cpu")[1]
    assert (plan.global_batch, plan.micro_batch, plan.accumulation) == (64, 8, 4)
    assert prepare_ds_config(override_batch(gpu, micro_batch=4), layout, device_type="cpu")[1].accumulation == 64
    assert override_batch(gpu) is gpu
    cfg = config_from_args(build_parser().parse_args(["--deepspeed_config", "x.json", "--global-batch-size", "64",
                                                      "--micro-batch-size", "8"]))
    assert (cfg.global_batch_size, cfg.micro_batch_size) == (64, 8)
