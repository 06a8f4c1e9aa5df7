"""GPT-NeoX (transformers GPTNeoXForCausalLM, e.g. Pythia) <-> mtds.

NeoX's fused query_key_value interleaves per head: rows are [head, (q, k, v), head_dim]. Ours are
[(q, k, v), head, head_dim] so that ColumnParallelLinear's output_segments can hand each rank whole
heads of q, k and v; the table permutes between the two.
"""
from __future__ import annotations

from typing import Any

from mtds.model.config import ModelConfig

from mtds.hf.common import PLAIN_ATTENTION, read_rope, require, require_export, rope_to_hf
from mtds.hf.table import WeightMap

MODEL_TYPE = "gpt_neox"
HF_ARCHITECTURE = "GPTNeoXForCausalLM"
BASE_PREFIX = "gpt_neox."
IGNORED_KEYS = (r"\.attention\.bias$", r"\.attention\.masked_bias$", r"rotary_emb\.inv_freq$")
# Checkpoints on disk (Pythia, transformers 4) call the untied head embed_out; transformers 5 renames it
# to lm_head in memory. We write embed_out (loads in both) and read either.
KEY_ALIASES = {"embed_out.weight": ("lm_head.weight",)}

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    act = d.get("hidden_act", "gelu")
    require(act in _ACTIVATIONS, f"gpt_neox: hidden_act {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    # NeoX's MLP always has biases; attention_bias=False would need a separate flag for the out-proj.
    require(d.get("attention_bias", True), "gpt_neox: attention_bias=False is not supported (only True)")
    rope = read_rope(d, MODEL_TYPE, default_theta=10000.0, default_percent=0.25)   # plain RoPE only
    theta, percent = rope.theta, rope.percent
    hidden = d.get("hidden_size", 6144)
    return ModelConfig(
        vocab_size=d.get("vocab_size", 50432), hidden_size=hidden, num_layers=d.get("num_hidden_layers", 44),
        num_heads=d.get("num_attention_heads", 64), ffn_hidden_size=d.get("intermediate_size", 4 * hidden),
        max_position_embeddings=d.get("max_position_embeddings", 2048), position_embedding="rotary",
        rotary_percent=percent, rotary_base=theta, normalization="layernorm", norm_eps=d.get("layer_norm_eps", 1e-5),
        activation=_ACTIVATIONS[act], qkv_bias=True, linear_bias=True,
        parallel_residual=d.get("use_parallel_residual", True), tie_word_embeddings=d.get("tie_word_embeddings", False),
        hidden_dropout=float(d.get("hidden_dropout", 0.0)), attention_dropout=float(d.get("attention_dropout", 0.0)),
        init_std=d.get("initializer_range", 0.02), architecture="gpt_neox")


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require_export(cfg, MODEL_TYPE, position_embedding="rotary", normalization="layernorm",
                   activation=("gelu", "gelu_tanh"), qkv_bias=True, linear_bias=True, kv_heads=cfg.num_heads,
                   **PLAIN_ATTENTION)
    return {"model_type": MODEL_TYPE, "architectures": [HF_ARCHITECTURE], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.ffn_size,
            "hidden_act": "gelu" if cfg.activation == "gelu" else "gelu_new",
            "max_position_embeddings": cfg.max_position_embeddings, "layer_norm_eps": cfg.norm_eps,
            "use_parallel_residual": cfg.parallel_residual, "tie_word_embeddings": cfg.tie_word_embeddings,
            "hidden_dropout": cfg.hidden_dropout, "attention_dropout": cfg.attention_dropout,
            "initializer_range": cfg.init_std, "attention_bias": True,
            "rotary_pct": cfg.rotary_percent, "rotary_emb_base": cfg.rotary_base, **rope_to_hf(cfg)}


def weight_table(cfg: ModelConfig) -> list[WeightMap]:
    L = cfg.num_layers
    rows = [WeightMap(0, "word_embeddings.weight", ("gpt_neox.embed_in.weight",))]
    for i in range(1, L + 1):
        p = f"gpt_neox.layers.{i - 1}."
        for ours, hf in (("input_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                         ("attention.out_proj", "attention.dense"), ("mlp.fc_in", "mlp.dense_h_to_4h"),
                         ("mlp.fc_out", "mlp.dense_4h_to_h")):
            rows += [WeightMap(i, f"{ours}.weight", (p + hf + ".weight",)),
                     WeightMap(i, f"{ours}.bias", (p + hf + ".bias",))]
        rows += [WeightMap(i, "attention.qkv.weight", (p + "attention.query_key_value.weight",), "neox_qkv",
                           heads=cfg.num_heads),
                 WeightMap(i, "attention.qkv.bias", (p + "attention.query_key_value.bias",), "neox_qkv",
                           heads=cfg.num_heads)]
    rows += [WeightMap(L + 1, "norm.weight", ("gpt_neox.final_layer_norm.weight",)),
             WeightMap(L + 1, "norm.bias", ("gpt_neox.final_layer_norm.bias",))]
    if not cfg.tie_word_embeddings:
        rows.append(WeightMap(L + 2, "weight", ("embed_out.weight",)))
    return rows
