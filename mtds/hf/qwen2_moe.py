"""Qwen2-MoE / Qwen1.5-MoE (transformers Qwen2MoeForCausalLM) <-> mtds: Qwen2's attention (biases on q/k/v, none
on o_proj) with an MoE block where transformers puts one (block i, 0-based, is MoE when it is not in
``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` == 0; else a dense SwiGLU MLP of ``intermediate_size``).
Each MoE block has ``num_experts`` routed experts of ``moe_intermediate_size`` (softmax top-k, renormalised only
with ``norm_topk_prob``) and one shared expert of ``shared_expert_intermediate_size`` whose output is scaled by
sigmoid(``shared_expert_gate``(x)) (mtds.model.shared_expert). A sliding window on any layer is refused.
"""
from __future__ import annotations

from typing import Any

from mtds.model.config import ModelConfig

from mtds.hf import llama_like
from mtds.hf.common import require, require_export

MODEL_TYPE = "qwen2_moe"
HF_ARCHITECTURE = "Qwen2MoeForCausalLM"
BASE_PREFIX = "model."
IGNORED_KEYS = llama_like.IGNORED_KEYS
KEY_ALIASES: dict[str, tuple[str, ...]] = {}
DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
            "num_key_value_heads": 16, "intermediate_size": 5632, "max_position_embeddings": 32768,
            "tie_word_embeddings": False, "num_experts": 60, "num_experts_per_tok": 4,
            "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
            "router_aux_loss_coef": 0.001}


def _refuse_sliding_window(d: dict[str, Any]) -> None:
    """transformers' rule: with use_sliding_window, blocks i with (i + 1) odd and i < max_window_layers slide
    (or as ``layer_types`` says)."""
    if not d.get("use_sliding_window", False):
        return
    layers = d.get("num_hidden_layers") or DEFAULTS["num_hidden_layers"]
    first = d.get("max_window_layers", 28)
    types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 and i < first else "full_attention"
                                     for i in range(layers)]
    require("sliding_attention" not in types,
            f"{MODEL_TYPE}: use_sliding_window=True (sliding_window {d.get('sliding_window')} on the layers "
            f"layer_types marks) is not supported: only full attention; set use_sliding_window false")


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    def get(key: str) -> Any:
        return d[key] if d.get(key) is not None else DEFAULTS[key]

    _refuse_sliding_window(d)
    experts = d.get("num_experts") or d.get("num_local_experts") or DEFAULTS["num_experts"]
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    shared = get("shared_expert_intermediate_size")
    require(shared > 0, f"{MODEL_TYPE}: shared_expert_intermediate_size {shared} must be positive (every "
                        f"Qwen2-MoE block has a shared expert)")
    return llama_like.config_from_hf(
        d, MODEL_TYPE, DEFAULTS, kv_channels=d.get("head_dim") or hidden // heads,
        qkv_bias=bool(d.get("qkv_bias", True)), out_proj_bias=False, linear_bias=False, num_experts=experts,
        moe_top_k=get("num_experts_per_tok"), moe_ffn_hidden_size=get("moe_intermediate_size"),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)), router_aux_loss_coef=float(get("router_aux_loss_coef")),
        decoder_sparse_step=get("decoder_sparse_step"), mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
        moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require_export(cfg, MODEL_TYPE, has_out_proj_bias=False, linear_bias=False, qk_norm=False, sliding_window=None,
                   moe_shared_expert_gate=True)
    require(cfg.num_experts > 0 and cfg.moe_shared_expert_intermediate_size is not None,
            f"cannot export to {MODEL_TYPE}: it needs routed experts and a gated shared expert")
    out = {**llama_like.config_to_hf(cfg, MODEL_TYPE, HF_ARCHITECTURE), "qkv_bias": cfg.qkv_bias,
           "use_sliding_window": False, "sliding_window": None,
           "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_top_k,
           "moe_intermediate_size": cfg.moe_ffn_size, "norm_topk_prob": cfg.norm_topk_prob,
           "shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
           "router_aux_loss_coef": cfg.router_aux_loss_coef, "decoder_sparse_step": cfg.decoder_sparse_step,
           "mlp_only_layers": list(cfg.mlp_only_layers)}
    if cfg.kv_channels is None:   # as Qwen2: head_dim written only where it is not h / a
        del out["head_dim"]
    return out


weight_table = llama_like.weight_table
