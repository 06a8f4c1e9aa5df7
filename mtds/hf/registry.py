"""Registry of per-architecture adapters and the architecture-agnostic entry points that dispatch to them.

Each adapter module (gpt2, neox, llama, qwen2, qwen3, mistral, mixtral, qwen3_moe, qwen2_moe, deepseek_v3,
gpt_oss) provides MODEL_TYPE, HF_ARCHITECTURE, BASE_PREFIX, IGNORED_KEYS, KEY_ALIASES, config_from_hf(dict), config_to_hf(cfg) and weight_table(cfg).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Iterable, Iterator

import torch

from mtds.model.config import ModelConfig

from mtds.hf import deepseek_v3, gpt2, gpt_oss, llama, mistral, mixtral, neox, qwen2, qwen2_moe, qwen3, qwen3_moe
from mtds.hf.common import UnsupportedHFConfig
from mtds.hf.table import WeightMap, table_to_hf, table_to_layers

ADAPTERS: dict[str, ModuleType] = {m.MODEL_TYPE: m for m in (gpt2, neox, llama, qwen2, qwen3, mistral, mixtral,
                                                               qwen3_moe, qwen2_moe, deepseek_v3, gpt_oss)}

# Families users ask for, and what about them a Llama-shaped mtds layer does not compute (docs/hf_interop.md).
_NOT_YET = {"gemma": "embeddings scaled by sqrt(hidden_size), RMSNorm as (1 + weight), GeGLU MLP",
            "gemma2": "Gemma's, plus logit soft-capping, norms after each sublayer, alternating sliding windows",
            "gemma3": "Gemma 2's, plus q/k norm and a RoPE base per layer type",
            "gemma3_text": "Gemma 2's, plus q/k norm and a RoPE base per layer type",
            "phi": "attention and MLP in parallel from one LayerNorm, partial rotary, a biased LM head",
            "phi3": "fused qkv_proj / gate_up_proj and longrope scaling",
            "deepseek_v32": "DeepSeek-V3.2's sparse attention indexer is not built (DeepSeek-V3's attention is: "
                            "deepseek_v3)"}


def adapter_for(model_type: str) -> ModuleType:
    if model_type not in ADAPTERS:
        why = f" ({_NOT_YET[model_type]})" if model_type in _NOT_YET else ""
        raise UnsupportedHFConfig(f"HF model_type {model_type!r} is not supported{why}; "
                                  f"supported: {', '.join(ADAPTERS)}")
    return ADAPTERS[model_type]


def model_config_from_hf(hf_config: Any) -> ModelConfig:
    """ModelConfig from a transformers PretrainedConfig or a config.json dict."""
    d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    return adapter_for(d.get("model_type", "<missing model_type>")).config_from_hf(d)


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """config.json contents for cfg.architecture (refuses what that architecture cannot express)."""
    return adapter_for(cfg.architecture).config_to_hf(cfg)


def hf_config_from_model_config(cfg: ModelConfig):
    """transformers PretrainedConfig for export (save_pretrained, building the HF model)."""
    from transformers import AutoConfig
    d = dict(hf_config_dict(cfg))
    return AutoConfig.for_model(d.pop("model_type"), **d)


def weight_table(cfg: ModelConfig) -> list[WeightMap]:
    return adapter_for(cfg.architecture).weight_table(cfg)


def hf_state_to_layers(cfg: ModelConfig, get_tensor: Callable[[str], torch.Tensor],
                       layers: Iterable[int] | None = None) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Lazily yield (global layer index, {our param name: full tensor}), reading each HF key via
    get_tensor(key) only when its layer is reached; ``layers`` restricts to a subset (a pipeline stage)."""
    return table_to_layers(weight_table(cfg), get_tensor, layers)


def layers_to_hf_state(cfg: ModelConfig, layers) -> dict[str, torch.Tensor]:
    """HF state dict from {layer index: {name: full tensor}} (or an iterable of such pairs)."""
    return table_to_hf(weight_table(cfg), layers)
