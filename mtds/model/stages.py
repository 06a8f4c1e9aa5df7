"""The global layers one rank holds, and loading full logical tensors into them.

Global layer indices: 0 embedding, 1..L blocks, L+1 final norm, L+2 untied LM head. Both weight sources
use this: HF directories (mtds.hf.init) and mtds checkpoints at another layout (mtds.checkpoint.reshard_load).
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from mtds.model.config import ModelConfig

from mtds.model.shard import load_full_state


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


def load_layers_into_modules(modules: dict[int, nn.Module], layers: Iterator[tuple[int, dict[str, torch.Tensor]]],
                             tp_group) -> None:
    """Copy each (global layer, {name: full tensor}) into its module, sliced to this rank's TP shard."""
    for index, tensors in layers:
        load_full_state(modules[index], tensors, tp_group)
