"""Load HF weights into the layers this rank builds (``--init-from-hf``, ``mtds-eval --hf``): a pipeline
stage's layers, each sliced to this rank's tensor-parallel shard. Other stages' tensors are never read.
(mtds checkpoints take their own path: mtds.checkpoint.reshard_load.)"""
from __future__ import annotations

import json
import os

from torch import nn

from mtds.model.stages import stage_modules
from mtds.model.config import ModelConfig, weight_differences

from mtds.hf.common import UnsupportedHFConfig

__all__ = ["stage_modules", "check_same_model", "hf_model_config", "load_hf_into_stages", "loaded_by_all"]


def check_same_model(expected: ModelConfig, found: ModelConfig, source: str) -> None:
    diff = weight_differences(expected, found)
    if diff:
        raise UnsupportedHFConfig(f"{source} holds a different model than the one being built: {'; '.join(diff[:3])}"
                                  f" -- pass the same directory as --model")


def hf_model_config(hf_dir: str) -> ModelConfig:
    from mtds.hf.registry import model_config_from_hf
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{hf_dir!r} has no config.json: not a HuggingFace model directory")
    with open(path) as f:
        return model_config_from_hf(json.load(f))


def load_hf_into_stages(model: nn.Module, hf_dir: str, model_cfg: ModelConfig, groups) -> dict[str, int]:
    """--init-from-hf: copy HF weights into this rank's layers and TP shards (reads only those tensors).
    Returns {HF tensor name: elements} of what this rank read (:func:`loaded_by_all` sums the ranks')."""
    from mtds.hf.load import load_hf_into_modules
    check_same_model(model_cfg, hf_model_config(hf_dir), hf_dir)
    read: dict[str, int] = {}
    load_hf_into_modules(model_cfg, stage_modules(model, model_cfg), hf_dir, groups.tp_group, read=read)
    return read


def loaded_by_all(read: dict[str, int]) -> tuple[int, int]:
    """(HF tensors, their parameters) that all ranks together loaded, each tensor once: one all-gather of the
    names over the default group (collective: every rank calls it)."""
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, read)
        read = {name: numel for part in everyone for name, numel in part.items()}
    return len(read), sum(read.values())
