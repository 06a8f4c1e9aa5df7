"""Llama (transformers LlamaForCausalLM) <-> mtds, Llama 3.x RoPE scalings (llama3, linear, yarn) included.

Llama's ``attention_bias`` covers q/k/v and o_proj alike, ``mlp_bias`` the three MLP projections.
The shared Llama-shaped parts (config keys, weight table) are in :mod:`mtds.hf.llama_like`.
"""
from __future__ import annotations

from typing import Any

from mtds.model.config import ModelConfig

from mtds.hf import llama_like
from mtds.hf.common import require_export

MODEL_TYPE = "llama"
HF_ARCHITECTURE = "LlamaForCausalLM"
BASE_PREFIX = "model."
IGNORED_KEYS = llama_like.IGNORED_KEYS
KEY_ALIASES: dict[str, tuple[str, ...]] = {}
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "intermediate_size": 11008, "max_position_embeddings": 2048, "tie_word_embeddings": False}


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    hidden = d.get("hidden_size") or DEFAULTS["hidden_size"]
    heads = d.get("num_attention_heads") or DEFAULTS["num_attention_heads"]
    attn_bias, mlp_bias = bool(d.get("attention_bias", False)), bool(d.get("mlp_bias", False))
    return llama_like.config_from_hf(d, MODEL_TYPE, DEFAULTS, kv_channels=d.get("head_dim") or hidden // heads,
                                     qkv_bias=attn_bias, out_proj_bias=attn_bias, linear_bias=mlp_bias)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require_export(cfg, MODEL_TYPE, has_out_proj_bias=cfg.qkv_bias, qk_norm=False, sliding_window=None)
    return {**llama_like.config_to_hf(cfg, MODEL_TYPE, HF_ARCHITECTURE), "attention_bias": cfg.qkv_bias,
            "mlp_bias": cfg.linear_bias}


weight_table = llama_like.weight_table
