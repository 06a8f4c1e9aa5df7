"""Qwen2 / Qwen2.5 (transformers Qwen2ForCausalLM) <-> mtds: Llama-shaped, with biases on q/k/v only
(none on o_proj or the MLP).

Qwen2's optional sliding window (``use_sliding_window``, on the layers from ``max_window_layers`` on) is
refused: the released models train and ship with it off.
"""
from __future__ import annotations

from typing import Any

from mtds.model.config import ModelConfig

from mtds.hf import llama_like
from mtds.hf.common import require, require_export

MODEL_TYPE = "qwen2"
HF_ARCHITECTURE = "Qwen2ForCausalLM"
BASE_PREFIX = "model."
IGNORED_KEYS = llama_like.IGNORED_KEYS
KEY_ALIASES: dict[str, tuple[str, ...]] = {}
DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "intermediate_size": 22016, "max_position_embeddings": 32768, "tie_word_embeddings": False}


def refuse_sliding_window(d: dict[str, Any], arch: str) -> None:
    """Qwen2/Qwen3: a window on any layer (use_sliding_window and a layer at or past max_window_layers) is
    refused; one that reaches no layer, or is switched off, is full attention as transformers runs it."""
    if not d.get("use_sliding_window", False) or d.get("sliding_window") is None:
        return
    layers = d.get("num_hidden_layers") or DEFAULTS["num_hidden_layers"]
    first = d.get("max_window_layers", 28)
    types = d.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    require("sliding_attention" not in types,
            f"{arch}: use_sliding_window=True (sliding_window {d['sliding_window']} from layer max_window_layers="
            f"{first}) is not supported: only full attention; set use_sliding_window false")


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    refuse_sliding_window(d, MODEL_TYPE)
    hidden = d.get("hidden_size") or DEFAULTS["hidden_size"]
    heads = d.get("num_attention_heads") or DEFAULTS["num_attention_heads"]
    return llama_like.config_from_hf(d, MODEL_TYPE, DEFAULTS, kv_channels=d.get("head_dim") or hidden // heads,
                                     qkv_bias=True, out_proj_bias=False, linear_bias=False)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require_export(cfg, MODEL_TYPE, qkv_bias=True, has_out_proj_bias=False, linear_bias=False, qk_norm=False,
                   sliding_window=None)
    out = {**llama_like.config_to_hf(cfg, MODEL_TYPE, HF_ARCHITECTURE), "use_sliding_window": False,
           "sliding_window": None}
    if cfg.kv_channels is None:   # Qwen2Config has no head_dim field: written only where it is not h / a
        del out["head_dim"]
    return out


weight_table = llama_like.weight_table
