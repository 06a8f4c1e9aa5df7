"""Qwen3 (transformers Qwen3ForCausalLM) <-> mtds: Llama-shaped, with a per-head RMSNorm on q and k before
RoPE (``q_norm``/``k_norm``: head_dim weights shared by the heads) and an explicit ``head_dim`` that need
not be hidden_size / heads (Qwen3 defaults it to 128). ``attention_bias`` covers q/k/v and o_proj; the
MLP has none. Sliding windows are refused as for Qwen2.
"""
from __future__ import annotations

from typing import Any

from mtds.model.config import ModelConfig

from mtds.hf import llama_like
from mtds.hf.common import require_export
from mtds.hf.qwen2 import refuse_sliding_window

MODEL_TYPE = "qwen3"
HF_ARCHITECTURE = "Qwen3ForCausalLM"
BASE_PREFIX = "model."
IGNORED_KEYS = llama_like.IGNORED_KEYS
KEY_ALIASES: dict[str, tuple[str, ...]] = {}
DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "intermediate_size": 22016, "max_position_embeddings": 32768, "tie_word_embeddings": False}
DEFAULT_HEAD_DIM = 128   # Qwen3Config's, whatever hidden_size / heads is


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    refuse_sliding_window(d, MODEL_TYPE)
    bias = bool(d.get("attention_bias", False))
    return llama_like.config_from_hf(d, MODEL_TYPE, DEFAULTS, kv_channels=d.get("head_dim") or DEFAULT_HEAD_DIM,
                                     qkv_bias=bias, out_proj_bias=bias, linear_bias=False, qk_norm=True)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require_export(cfg, MODEL_TYPE, has_out_proj_bias=cfg.qkv_bias, linear_bias=False, qk_norm=True,
                   sliding_window=None)
    return {**llama_like.config_to_hf(cfg, MODEL_TYPE, HF_ARCHITECTURE), "attention_bias": cfg.qkv_bias,
            "use_sliding_window": False, "sliding_window": None}


weight_table = llama_like.weight_table
