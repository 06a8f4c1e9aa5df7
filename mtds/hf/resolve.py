"""Which model to build: a preset name, a HF config (file, directory, dict or transformers config) or a
ModelConfig, resolved to one :class:`ModelConfig`.

The dataclass and the presets live in :mod:`mtds.model.config`. HF configs are read by the adapters
(``mtds.hf.registry``), imported only when one is given: a preset name needs no torch.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from mtds.model.config import PRESETS, ModelConfig

__all__ = ["resolve_model_config"]


def resolve_model_config(name_or_path: Any, **overrides: Any) -> ModelConfig:
    """A ModelConfig from a preset name, a HF config.json (file or directory holding one), a
    transformers PretrainedConfig, a plain HF config dict, or a ModelConfig; then apply overrides."""
    cfg = _resolve_base(name_or_path)
    if not overrides:
        return cfg
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown ModelConfig override(s) {unknown}; valid fields: {', '.join(sorted(known))}")
    return dataclasses.replace(cfg, **overrides)


def _resolve_base(source: Any) -> ModelConfig:
    if isinstance(source, ModelConfig):
        return source
    if isinstance(source, dict) or hasattr(source, "to_dict"):
        from mtds.hf.registry import model_config_from_hf   # HF configs only: imports torch
        return model_config_from_hf(source)
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        if name in PRESETS:
            return PRESETS[name]
        path = os.path.join(name, "config.json") if os.path.isdir(name) else name
        if os.path.isfile(path):
            with open(path) as f:
                from mtds.hf.registry import model_config_from_hf
                try:
                    hf_config = json.load(f)
                except json.JSONDecodeError as err:
                    raise ValueError(f"model config {path!r} is not valid JSON ({err}): pass a HF config.json or "
                                     f"a preset name") from None
                return model_config_from_hf(hf_config)
    raise ValueError(f"unknown model {source!r}: use a preset ({', '.join(PRESETS)}) or a HF config.json "
                     f"file/directory")
