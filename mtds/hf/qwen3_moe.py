"""Qwen3-MoE (transformers Qwen3MoeForCausalLM) <-> mtds: Qwen3's attention (q/k norm, explicit head_dim) with
an MoE block where transformers puts one: block i (0-based) is MoE when it is not in ``mlp_only_layers`` and
(i + 1) % ``decoder_sparse_step`` == 0, else a dense SwiGLU MLP of ``intermediate_size``. Experts are
``moe_intermediate_size`` wide; the k probabilities are renormalised only with ``norm_topk_prob``; the
load-balancing loss is weighted by ``router_aux_loss_coef`` (mtds.model.moe, docs/moe.md). With
``use_sliding_window`` every layer slides, as transformers 5 runs it.
"""
from __future__ import annotations

from typing import Any

from mtds.model.config import ModelConfig

from mtds.hf import llama_like
from mtds.hf.common import require, require_export

MODEL_TYPE = "qwen3_moe"
HF_ARCHITECTURE = "Qwen3MoeForCausalLM"
BASE_PREFIX = "model."
IGNORED_KEYS = llama_like.IGNORED_KEYS
KEY_ALIASES: dict[str, tuple[str, ...]] = {}
DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32,
            "num_key_value_heads": 4, "intermediate_size": 6144, "max_position_embeddings": 32768,
            "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
            "moe_intermediate_size": 768, "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001}


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    def get(key: str) -> Any:
        return d[key] if d.get(key) is not None else DEFAULTS[key]

    # config.json spells it num_experts; transformers 5's to_dict num_local_experts (its attribute_map)
    experts = d.get("num_experts") or d.get("num_local_experts") or DEFAULTS["num_experts"]
    bias = bool(d.get("attention_bias", False))
    # unlike dense Qwen3 (128), Qwen3MoeAttention defaults head_dim to hidden_size / heads
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    return llama_like.config_from_hf(
        d, MODEL_TYPE, DEFAULTS, kv_channels=d.get("head_dim") or hidden // heads, qkv_bias=bias,
        out_proj_bias=bias, linear_bias=False, qk_norm=True, sliding_window=window, num_experts=experts,
        moe_top_k=get("num_experts_per_tok"), moe_ffn_hidden_size=get("moe_intermediate_size"),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)), router_aux_loss_coef=float(get("router_aux_loss_coef")),
        decoder_sparse_step=get("decoder_sparse_step"), mlp_only_layers=tuple(d.get("mlp_only_layers") or ()))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require_export(cfg, MODEL_TYPE, has_out_proj_bias=cfg.qkv_bias, linear_bias=False, qk_norm=True)
    require(cfg.num_experts > 0, f"cannot export to {MODEL_TYPE}: the model has no experts")
    return {**llama_like.config_to_hf(cfg, MODEL_TYPE, HF_ARCHITECTURE), "attention_bias": cfg.qkv_bias,
            "use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
            "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_top_k,
            "moe_intermediate_size": cfg.moe_ffn_size, "norm_topk_prob": cfg.norm_topk_prob,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "decoder_sparse_step": cfg.decoder_sparse_step,
            "mlp_only_layers": list(cfg.mlp_only_layers)}


weight_table = llama_like.weight_table
