"""GPT-OSS (transformers GptOssForCausalLM) <-> mtds: Llama-shaped attention with biases on q/k/v/o
(``attention_bias``), a learned sink logit per head in every softmax (mtds.model.attention_sinks), sliding and
full attention as ``layer_types`` alternate (every N-th block full: ``window_attn_skip_freq``), YaRN RoPE; every
block MoE: a router with a bias, softmax over the top-k logits (= the top-k probabilities renormalised), and
experts with biases whose activation is the clamped quick-GeGLU, (clamp(up, ±limit) + 1) · g · sigmoid(1.702 g),
g = min(gate, limit) (mtds.model.glu). transformers stores each block's experts as 3-D tensors, gate and up
interleaved on the last dim of ``gate_up_proj`` [E, h, 2F]; mtds's [E, 2F, h] holds [gate | up].

Refused, one line each: a quantized checkpoint (``quantization_config``, the released MXFP4 files: dequantize
first), ``swiglu_alpha`` other than 1.702, a ``layer_types`` pattern other than "every N-th block full",
``swiglu_limit`` null.
"""
from __future__ import annotations

from typing import Any

from mtds.model.config import ROPE_SCALINGS, ModelConfig

from mtds.hf import llama_like
from mtds.hf.common import read_rope, require, require_export, rope_to_hf

MODEL_TYPE = "gpt_oss"
HF_ARCHITECTURE = "GptOssForCausalLM"
BASE_PREFIX = "model."
IGNORED_KEYS = llama_like.IGNORED_KEYS
KEY_ALIASES: dict[str, tuple[str, ...]] = {}
DEFAULTS = {"vocab_size": 201088, "hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "max_position_embeddings": 131072,
            "tie_word_embeddings": False, "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
            "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001, "rms_norm_eps": 1e-5}
# transformers' GptOssConfig default RoPE, for a config.json without one
DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
SWIGLU_ALPHA = 1.702


def _windows(d: dict[str, Any], layers: int) -> tuple[int | None, int | None]:
    """(sliding_window, window_attn_skip_freq) of ``layer_types`` (transformers' default: block i slides when
    i + 1 is odd)."""
    types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    require(len(types) == layers and set(types) <= {"sliding_attention", "full_attention"},
            f"{MODEL_TYPE}: layer_types {types} must name sliding_attention or full_attention for each of the "
            f"{layers} blocks")
    if "sliding_attention" not in types:
        return None, None
    window = d.get("sliding_window")
    require(isinstance(window, int) and window > 0, f"{MODEL_TYPE}: sliding_window {window!r} must be a positive "
                                                    f"int where layer_types has sliding_attention")
    if "full_attention" not in types:
        return window, None
    freq = types.index("full_attention") + 1
    want = ["full_attention" if (i + 1) % freq == 0 else "sliding_attention" for i in range(layers)]
    require(types == want and freq >= 2, f"{MODEL_TYPE}: layer_types {types} is not supported; built: every N-th "
                                         f"block full attention, the others sliding (transformers' default: N = 2)")
    return window, freq


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    def get(key: str) -> Any:
        return d[key] if d.get(key) is not None else DEFAULTS[key]

    require(not d.get("quantization_config"), f"{MODEL_TYPE}: a quantized checkpoint (quantization_config "
                                              f"{(d.get('quantization_config') or {}).get('quant_method', '?')!r}) is "
                                              f"not supported: dequantize it first (transformers' Mxfp4Config("
                                              f"dequantize=True), then save_pretrained)")
    alpha = d.get("swiglu_alpha", SWIGLU_ALPHA)
    require(alpha == SWIGLU_ALPHA, f"{MODEL_TYPE}: swiglu_alpha {alpha} is not supported (only {SWIGLU_ALPHA}, "
                                   f"quick_gelu's)")
    limit = d.get("swiglu_limit", DEFAULTS["swiglu_limit"])
    require(limit is not None and limit > 0, f"{MODEL_TYPE}: swiglu_limit {limit!r} must be a positive number")
    layers, heads = get("num_hidden_layers"), get("num_attention_heads")
    window, freq = _windows(d, layers)
    rope_source = d if d.get("rope_scaling") or d.get("rope_parameters") else {**d, "rope_parameters": DEFAULT_ROPE}
    rope = read_rope(rope_source, MODEL_TYPE, default_theta=DEFAULT_ROPE["rope_theta"], default_percent=1.0,
                     scalings=ROPE_SCALINGS)
    require(rope.percent == 1.0, f"{MODEL_TYPE}: partial_rotary_factor {rope.percent} is not supported (only 1.0)")
    bias = bool(d.get("attention_bias", True))
    experts = d.get("num_local_experts") or d.get("num_experts") or DEFAULTS["num_local_experts"]
    return ModelConfig(
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_layers=layers, num_heads=heads,
        num_kv_heads=get("num_key_value_heads"), kv_channels=get("head_dim"), ffn_hidden_size=get("intermediate_size"),
        max_position_embeddings=get("max_position_embeddings"), position_embedding="rotary", rotary_percent=1.0,
        rotary_base=rope.theta, rope_scaling=rope.scaling, rope_scaling_params=rope.params, normalization="rmsnorm",
        norm_eps=get("rms_norm_eps"), activation="quick_geglu", qkv_bias=bias, linear_bias=True, out_proj_bias=bias,
        sliding_window=window, window_attn_skip_freq=freq, softmax_type="learnable",
        tie_word_embeddings=bool(get("tie_word_embeddings")), hidden_dropout=0.0,
        attention_dropout=float(d.get("attention_dropout") or 0.0), init_std=d.get("initializer_range", 0.02),
        architecture=MODEL_TYPE, num_experts=experts, moe_top_k=get("num_experts_per_tok"),
        moe_ffn_hidden_size=get("intermediate_size"), norm_topk_prob=True,
        router_aux_loss_coef=float(get("router_aux_loss_coef")), glu_linear_offset=1.0,
        activation_func_clamp_value=float(limit))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require_export(cfg, MODEL_TYPE, position_embedding="rotary", rotary_percent=1.0, normalization="rmsnorm",
                   activation="quick_geglu", parallel_residual=False, hidden_dropout=0.0, linear_bias=True,
                   has_out_proj_bias=cfg.qkv_bias, qk_norm=False, softmax_type="learnable", glu_linear_offset=1.0,
                   norm_topk_prob=True, decoder_sparse_step=1,
                   moe_shared_expert_intermediate_size=None, moe_router_score_function="softmax",
                   moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False,
                   multi_latent_attention=False)
    require(cfg.num_experts > 0 and cfg.activation_func_clamp_value is not None and not cfg.mlp_only_layers,
            f"cannot export to {MODEL_TYPE}: it needs experts in every block and activation_func_clamp_value "
            f"(swiglu_limit)")
    types = ["full_attention" if cfg.attention_window(i + 1) is None else "sliding_attention"
             for i in range(cfg.num_layers)]
    return {"model_type": MODEL_TYPE, "architectures": [HF_ARCHITECTURE], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.moe_ffn_size, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_word_embeddings, "attention_dropout": cfg.attention_dropout,
            "initializer_range": cfg.init_std, **rope_to_hf(cfg), "attention_bias": cfg.qkv_bias,
            "sliding_window": cfg.sliding_window, "layer_types": types, "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.moe_top_k, "swiglu_limit": cfg.activation_func_clamp_value,
            "swiglu_alpha": SWIGLU_ALPHA, "router_aux_loss_coef": cfg.router_aux_loss_coef,
            "output_router_logits": False}


weight_table = llama_like.weight_table
