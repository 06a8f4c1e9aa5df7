"""Parameter names as DeepSpeed sees them <-> (global layer index, name inside that layer).

Two module shapes hold the same layers:
  PipelineModule (p > 1): "<spec index>.<name>", the tied embedding "tied_modules.embed.<name>";
                          spec index == global layer index (the tied head shares index 0's weights).
  SequentialGPT  (p = 1): "embedding.<name>", "layers.<i-1>.<name>", "final_norm.<name>", "lm_head.<name>".
"""
from __future__ import annotations

import re

from mtds.model.config import ModelConfig

TIED_PREFIX = "tied_modules.embed."
_PIPE = re.compile(r"^(\d+)\.(.+)$")
_SEQ_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def parse(cfg: ModelConfig, ds_name: str) -> tuple[int, str]:
    """(global layer, name in layer) of a DeepSpeed parameter name in either naming."""
    if ds_name.startswith(TIED_PREFIX):
        return 0, ds_name[len(TIED_PREFIX):]
    for prefix, layer in (("embedding.", 0), ("final_norm.", cfg.num_layers + 1), ("lm_head.", cfg.num_layers + 2)):
        if ds_name.startswith(prefix):
            return layer, ds_name[len(prefix):]
    m = _SEQ_LAYER.match(ds_name)
    if m:
        return int(m.group(1)) + 1, m.group(2)
    m = _PIPE.match(ds_name)
    if m:
        return int(m.group(1)), m.group(2)
    raise KeyError(f"parameter name {ds_name!r} is not an mtds GPT parameter")


def pipeline_name(cfg: ModelConfig, layer: int, name: str) -> str:
    if layer == 0 and cfg.tie_word_embeddings:
        return TIED_PREFIX + name
    return f"{layer}.{name}"


def sequential_name(cfg: ModelConfig, layer: int, name: str) -> str:
    L = cfg.num_layers
    if layer == 0:
        return "embedding." + name
    if layer <= L:
        return f"layers.{layer - 1}.{name}"
    return ("final_norm." if layer == L + 1 else "lm_head.") + name


def ds_name(cfg: ModelConfig, layer: int, name: str, pipeline: bool) -> str:
    return pipeline_name(cfg, layer, name) if pipeline else sequential_name(cfg, layer, name)
