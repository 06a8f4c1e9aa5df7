"""Mistral (transformers MistralForCausalLM) <-> mtds: Llama-shaped without biases, with a sliding-window
causal mask of ``sliding_window`` keys on every layer (null: full attention; Mistral 7B v0.1: 4096).
A window at least as long as the training sequence is plain causal attention; a shorter one is masked
(:mod:`mtds.model.sliding_window`), as transformers does.
"""
from __future__ import annotations

from typing import Any

from mtds.model.config import ModelConfig

from mtds.hf import llama_like
from mtds.hf.common import require_export

MODEL_TYPE = "mistral"
HF_ARCHITECTURE = "MistralForCausalLM"
BASE_PREFIX = "model."
IGNORED_KEYS = llama_like.IGNORED_KEYS
KEY_ALIASES: dict[str, tuple[str, ...]] = {}
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "max_position_embeddings": 4096 * 32,
            "tie_word_embeddings": False}
DEFAULT_WINDOW = 4096   # MistralConfig's when the key is absent


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    hidden = d.get("hidden_size") or DEFAULTS["hidden_size"]
    heads = d.get("num_attention_heads") or DEFAULTS["num_attention_heads"]
    window = d.get("sliding_window", DEFAULT_WINDOW)   # an explicit null: no window
    return llama_like.config_from_hf(d, MODEL_TYPE, DEFAULTS, kv_channels=d.get("head_dim") or hidden // heads,
                                     qkv_bias=False, out_proj_bias=False, linear_bias=False, sliding_window=window)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require_export(cfg, MODEL_TYPE, qkv_bias=False, has_out_proj_bias=False, linear_bias=False, qk_norm=False)
    return {**llama_like.config_to_hf(cfg, MODEL_TYPE, HF_ARCHITECTURE), "sliding_window": cfg.sliding_window}


weight_table = llama_like.weight_table
