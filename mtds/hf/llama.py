"""Llama (transformers LlamaForCausalLM) <-> mtds.

Llama keeps q/k/v and gate/up as separate projections; we fuse them ([q | k | v], [gate | up]) so one
ColumnParallelLinear with output_segments serves each, giving every rank whole query and key/value heads
(grouped-query attention: t must divide num_key_value_heads).
"""
from __future__ import annotations

from typing import Any

from mtds.model.config import ModelConfig

from mtds.hf.common import read_rope, require, require_export, rope_to_hf
from mtds.hf.table import WeightMap

MODEL_TYPE = "llama"
HF_ARCHITECTURE = "LlamaForCausalLM"
BASE_PREFIX = "model."
IGNORED_KEYS = (r"rotary_emb\.inv_freq$",)
KEY_ALIASES: dict[str, tuple[str, ...]] = {}


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    act = d.get("hidden_act", "silu")
    require(act == "silu", f"llama: hidden_act {act!r} is not supported; supported: silu (SwiGLU)")
    hidden, heads = d.get("hidden_size", 4096), d.get("num_attention_heads", 32)
    head_dim = d.get("head_dim") or hidden // heads
    require(head_dim * heads == hidden, f"llama: head_dim {head_dim} * heads {heads} != hidden_size {hidden} "
                                        f"is not supported (only head_dim = hidden_size / heads)")
    attn_bias, mlp_bias = bool(d.get("attention_bias", False)), bool(d.get("mlp_bias", False))
    # mtds has qkv_bias (q/k/v) and linear_bias (o_proj and the MLP); Llama ties o_proj's bias to q/k/v's.
    require(attn_bias == mlp_bias, f"llama: attention_bias={attn_bias} with mlp_bias={mlp_bias} is not supported "
                                   f"(only both True or both False)")
    theta, percent = read_rope(d, MODEL_TYPE, default_theta=10000.0, default_percent=1.0)
    require(percent == 1.0, f"llama: partial_rotary_factor {percent} is not supported (only 1.0)")
    return ModelConfig(
        vocab_size=d.get("vocab_size", 32000), hidden_size=hidden, num_layers=d.get("num_hidden_layers", 32),
        num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
        ffn_hidden_size=d.get("intermediate_size", 11008),
        max_position_embeddings=d.get("max_position_embeddings", 2048), position_embedding="rotary",
        rotary_percent=1.0, rotary_base=theta, normalization="rmsnorm", norm_eps=d.get("rms_norm_eps", 1e-6),
        activation="swiglu", qkv_bias=attn_bias, linear_bias=mlp_bias, parallel_residual=False,
        tie_word_embeddings=d.get("tie_word_embeddings", False), hidden_dropout=0.0,
        attention_dropout=float(d.get("attention_dropout", 0.0)), init_std=d.get("initializer_range", 0.02),
        architecture="llama")


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require_export(cfg, MODEL_TYPE, position_embedding="rotary", rotary_percent=1.0, normalization="rmsnorm",
                   activation="swiglu", linear_bias=cfg.qkv_bias, parallel_residual=False, hidden_dropout=0.0)
    return {"model_type": MODEL_TYPE, "architectures": [HF_ARCHITECTURE], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_size, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.qkv_bias,
            "mlp_bias": cfg.linear_bias, "attention_dropout": cfg.attention_dropout,
            "initializer_range": cfg.init_std, **rope_to_hf(cfg)}


def weight_table(cfg: ModelConfig) -> list[WeightMap]:
    L, d = cfg.num_layers, cfg.head_dim
    qkv_sizes = (cfg.num_heads * d, cfg.kv_heads * d, cfg.kv_heads * d)
    ffn_sizes = (cfg.ffn_size, cfg.ffn_size)
    rows = [WeightMap(0, "word_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(1, L + 1):
        p = f"model.layers.{i - 1}."
        rows += [WeightMap(i, "input_norm.weight", (p + "input_layernorm.weight",)),
                 WeightMap(i, "post_attention_norm.weight", (p + "post_attention_layernorm.weight",))]
        suffixes = (".weight", ".bias") if cfg.qkv_bias else (".weight",)
        for s in suffixes:
            rows.append(WeightMap(i, "attention.qkv" + s, tuple(p + f"self_attn.{x}_proj" + s for x in "qkv"),
                                  "concat", sizes=qkv_sizes))
        for s in ((".weight", ".bias") if cfg.linear_bias else (".weight",)):
            rows += [WeightMap(i, "attention.out_proj" + s, (p + "self_attn.o_proj" + s,)),
                     WeightMap(i, "mlp.fc_in" + s, (p + "mlp.gate_proj" + s, p + "mlp.up_proj" + s), "concat",
                               sizes=ffn_sizes),
                     WeightMap(i, "mlp.fc_out" + s, (p + "mlp.down_proj" + s,))]
    rows.append(WeightMap(L + 1, "norm.weight", ("model.norm.weight",)))
    if not cfg.tie_word_embeddings:
        rows.append(WeightMap(L + 2, "weight", ("lm_head.weight",)))
    return rows
