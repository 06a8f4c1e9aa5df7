"""Weights of an mtds checkpoint saved at any layout, resharded on the fly into the layers this rank builds.

The path of a weights-only checkpoint (``mtds-convert hf-to-mtds``) loaded at another layout, and of
``mtds-eval --checkpoint``: reader.py gives full logical tensors of the wanted layers only, which are
sliced to this rank's tensor-parallel shard (mtds.model.stages). Nothing of mtds.hf is involved.
"""
from __future__ import annotations

from torch import nn

from mtds.model.stages import load_layers_into_modules, stage_modules
from mtds.model.config import ModelConfig, weight_differences

from mtds.checkpoint.errors import CheckpointFormatError
from mtds.checkpoint.reader import open_checkpoint


def check_same_model(expected: ModelConfig, found: ModelConfig, source: str) -> None:
    """A one-line CheckpointFormatError when ``source`` holds weights of another model than ``expected``."""
    diff = weight_differences(expected, found)
    if diff:
        raise CheckpointFormatError(f"{source} holds a different model than the one being built: "
                                    f"{'; '.join(diff[:3])} -- pass the same directory as --model")


def load_checkpoint_into_stages(model: nn.Module, ckpt_dir: str, model_cfg: ModelConfig, tp_group) -> None:
    """Copy the checkpoint's weights into ``model``'s layers (this rank's stage and TP shard); reads only
    those layers."""
    ckpt = open_checkpoint(ckpt_dir)
    check_same_model(model_cfg, ckpt.cfg, ckpt_dir)
    modules = stage_modules(model, model_cfg)
    load_layers_into_modules(modules, ckpt.layers(modules.keys()), tp_group)
