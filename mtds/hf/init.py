"""Load HF (or mtds-checkpoint) weights into the layers this rank builds: a pipeline stage's layers,
each sliced to this rank's tensor-parallel shard. Other stages' tensors are never read."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

import torch
from torch import nn

from mtds.config import ModelConfig

from .common import UnsupportedHFConfig


def stage_modules(model: nn.Module, cfg: ModelConfig) -> dict[int, nn.Module]:
    """{global layer index: module} for the layers this rank holds.

    PipelineModule registers spec i as attribute str(i) and tied modules under tied_modules[key];
    the tied embedding (stage 0 and, as the head, the last stage) is global layer 0 either way.
    """
    if hasattr(model, "tied_modules"):          # deepspeed.pipe.PipelineModule
        modules = {int(name): module for name, module in model.named_children() if name.isdigit()}
        if "embed" in model.tied_modules:
            modules[0] = model.tied_modules["embed"]
        return modules
    modules = {0: model.embedding}              # SequentialGPT / GPTModel
    modules.update({i + 1: layer for i, layer in enumerate(model.layers)})
    modules[cfg.num_layers + 1] = model.final_norm
    if getattr(model, "lm_head", None) is not None:
        modules[cfg.num_layers + 2] = model.lm_head
    return modules


# Fields that describe training, not the weights: an HF config may differ in them from --model.
_NOT_WEIGHTS = ("hidden_dropout", "attention_dropout", "init_std")


def check_same_model(expected: ModelConfig, found: ModelConfig, source: str) -> None:
    a = {k: v for k, v in dataclasses.asdict(expected).items() if k not in _NOT_WEIGHTS}
    b = {k: v for k, v in dataclasses.asdict(found).items() if k not in _NOT_WEIGHTS}
    diff = [f"{k}: {b[k]!r} (model has {a[k]!r})" for k in a if a[k] != b[k]]
    if diff:
        raise UnsupportedHFConfig(f"{source} holds a different model than the one being built: {'; '.join(diff[:3])}"
                                  f" -- pass the same directory as --model")


def hf_model_config(hf_dir: str) -> ModelConfig:
    from .registry import model_config_from_hf
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{hf_dir!r} has no config.json: not a HuggingFace model directory")
    with open(path) as f:
        return model_config_from_hf(json.load(f))


def load_layers_into_modules(cfg: ModelConfig, modules: dict[int, nn.Module],
                             layers: Iterator[tuple[int, dict[str, torch.Tensor]]], tp_group) -> None:
    from mtds.model.shard import load_full_state
    for index, tensors in layers:
        load_full_state(modules[index], tensors, tp_group)


def load_hf_into_stages(model: nn.Module, hf_dir: str, model_cfg: ModelConfig, groups) -> None:
    """--init-from-hf: copy HF weights into this rank's layers and TP shards (reads only those tensors)."""
    from .load import load_hf_into_modules
    check_same_model(model_cfg, hf_model_config(hf_dir), hf_dir)
    load_hf_into_modules(model_cfg, stage_modules(model, model_cfg), hf_dir, groups.tp_group)


def load_checkpoint_into_stages(model: nn.Module, ckpt_dir: str, model_cfg: ModelConfig, groups) -> None:
    """Weights of an mtds checkpoint saved at any layout, resharded on the fly to this rank's layers."""
    from mtds.reshard.reader import open_checkpoint
    ckpt = open_checkpoint(ckpt_dir)
    check_same_model(model_cfg, ckpt.cfg, ckpt_dir)
    modules = stage_modules(model, model_cfg)
    load_layers_into_modules(model_cfg, modules, ckpt.layers(modules.keys()), groups.tp_group)
