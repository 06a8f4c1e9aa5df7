"""Mixtral (transformers MixtralForCausalLM) <-> mtds: Mistral's attention (optional sliding window, no
biases) with an MoE block in every layer: ``num_local_experts`` SwiGLU experts of ``intermediate_size``,
top-``num_experts_per_tok`` routing renormalised over the k (always), the load-balancing loss weighted by
``router_aux_loss_coef`` (mtds.model.moe, docs/moe.md). Router jitter (training noise) is refused.
"""
from __future__ import annotations

from typing import Any

from mtds.model.config import ModelConfig

from mtds.hf import llama_like
from mtds.hf.common import require, require_export

MODEL_TYPE = "mixtral"
HF_ARCHITECTURE = "MixtralForCausalLM"
BASE_PREFIX = "model."
IGNORED_KEYS = llama_like.IGNORED_KEYS
KEY_ALIASES: dict[str, tuple[str, ...]] = {}
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "max_position_embeddings": 4096 * 32,
            "tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.001}


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    def get(key: str) -> Any:
        return d[key] if d.get(key) is not None else DEFAULTS[key]

    jitter = d.get("router_jitter_noise") or 0.0
    require(jitter == 0.0, f"{MODEL_TYPE}: router_jitter_noise {jitter} is not supported (only 0: no noise "
                           f"on the router input in training)")
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    return llama_like.config_from_hf(
        d, MODEL_TYPE, DEFAULTS, kv_channels=d.get("head_dim") or hidden // heads, qkv_bias=False,
        out_proj_bias=False, linear_bias=False, sliding_window=d.get("sliding_window"),
        num_experts=get("num_local_experts"), moe_top_k=get("num_experts_per_tok"),
        moe_ffn_hidden_size=get("intermediate_size"), norm_topk_prob=True,
        router_aux_loss_coef=float(get("router_aux_loss_coef")))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require_export(cfg, MODEL_TYPE, qkv_bias=False, has_out_proj_bias=False, linear_bias=False, qk_norm=False,
                   norm_topk_prob=True, decoder_sparse_step=1, moe_ffn_size=cfg.ffn_size)
    require(cfg.num_experts > 0, f"cannot export to {MODEL_TYPE}: the model has no experts")
    require(not cfg.mlp_only_layers, f"cannot export to {MODEL_TYPE}: every block is MoE there, this model has "
                                     f"dense blocks {list(cfg.mlp_only_layers)}")
    return {**llama_like.config_to_hf(cfg, MODEL_TYPE, HF_ARCHITECTURE), "sliding_window": cfg.sliding_window,
            "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_top_k,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "router_jitter_noise": 0.0}


weight_table = llama_like.weight_table
