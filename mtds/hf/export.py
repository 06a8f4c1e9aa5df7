"""Export: gather TP shards into full tensors, map them to HF names, write a from_pretrained-able dir."""
from __future__ import annotations

import json
import os
from typing import Mapping

import torch

from mtds.model.shard import full_state
from mtds.model.config import ModelConfig

from mtds.hf.registry import hf_config_dict, layers_to_hf_state


def model_to_layers(cfg: ModelConfig, modules: Mapping[int, torch.nn.Module], tp_group=None
                    ) -> dict[int, dict[str, torch.Tensor]]:
    """{global layer index: {name: full tensor}} gathered from TP shards (collective over tp_group)."""
    return {index: full_state(module, tp_group, cfg) for index, module in sorted(modules.items())}


def model_to_hf_state(model) -> dict[str, torch.Tensor]:
    """HF state dict of a GPTModel (collective over its TP group; every rank gets the full dict)."""
    return layers_to_hf_state(model.cfg, model_to_layers(model.cfg, model.global_layers(), model.tp_group))


def save_hf_checkpoint(cfg: ModelConfig, hf_state: Mapping[str, torch.Tensor], out_dir: str) -> None:
    """Write config.json + model.safetensors that transformers' from_pretrained can read."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg), f, indent=2)
    save_file({k: v.contiguous() for k, v in hf_state.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
