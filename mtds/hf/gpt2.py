"""GPT-2 (transformers GPT2LMHeadModel) <-> mtds.

GPT-2 uses Conv1D, which stores weights as [in, out]: every projection is transposed. Its fused
c_attn output is already [q | k | v], which is our segment order, so only the transpose is needed.
"""
from __future__ import annotations

from typing import Any

from mtds.model.config import ModelConfig

from mtds.hf.common import PLAIN_ATTENTION, require, require_export
from mtds.hf.table import WeightMap

MODEL_TYPE = "gpt2"
HF_ARCHITECTURE = "GPT2LMHeadModel"
BASE_PREFIX = "transformer."                       # old hub checkpoints store keys without it
IGNORED_KEYS = (r"\.attn\.bias$", r"\.attn\.masked_bias$")   # causal-mask buffers, not weights
KEY_ALIASES: dict[str, tuple[str, ...]] = {}

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    act = d.get("activation_function", "gelu_new")
    require(act in _ACTIVATIONS, f"gpt2: activation_function {act!r} is not supported; "
                                 f"supported: {', '.join(_ACTIVATIONS)}")
    require(d.get("scale_attn_weights", True), "gpt2: scale_attn_weights=False is not supported (only 1/sqrt(d))")
    require(not d.get("scale_attn_by_inverse_layer_idx", False),
            "gpt2: scale_attn_by_inverse_layer_idx=True is not supported")
    require(not d.get("add_cross_attention", False), "gpt2: add_cross_attention=True is not supported")
    resid, embd = d.get("resid_pdrop", 0.1), d.get("embd_pdrop", 0.1)
    require(resid == embd, f"gpt2: embd_pdrop {embd} != resid_pdrop {resid} is not supported "
                           f"(mtds has one hidden_dropout)")
    hidden = d.get("n_embd", d.get("hidden_size", 768))
    return ModelConfig(
        vocab_size=d.get("vocab_size", 50257), hidden_size=hidden, num_layers=d.get("n_layer", 12),
        num_heads=d.get("n_head", 12), ffn_hidden_size=d.get("n_inner") or 4 * hidden,
        max_position_embeddings=d.get("n_positions", 1024), position_embedding="learned",
        normalization="layernorm", norm_eps=d.get("layer_norm_epsilon", 1e-5), activation=_ACTIVATIONS[act],
        qkv_bias=True, linear_bias=True, parallel_residual=False,
        tie_word_embeddings=d.get("tie_word_embeddings", True), hidden_dropout=float(resid),
        attention_dropout=float(d.get("attn_pdrop", 0.1)), init_std=d.get("initializer_range", 0.02),
        architecture="gpt2")


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require_export(cfg, MODEL_TYPE, position_embedding="learned", normalization="layernorm",
                   activation=("gelu_tanh", "gelu"), qkv_bias=True, linear_bias=True, parallel_residual=False,
                   kv_heads=cfg.num_heads, **PLAIN_ATTENTION)
    return {"model_type": MODEL_TYPE, "architectures": [HF_ARCHITECTURE], "vocab_size": cfg.vocab_size,
            "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
            "n_inner": cfg.ffn_size, "n_positions": cfg.max_position_embeddings,
            "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
            "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout, "initializer_range": cfg.init_std,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            # GPT-2's default special token 50256 does not exist in a smaller vocabulary.
            **({} if cfg.vocab_size > 50256 else {"bos_token_id": None, "eos_token_id": None})}


def weight_table(cfg: ModelConfig) -> list[WeightMap]:
    L = cfg.num_layers
    rows = [WeightMap(0, "word_embeddings.weight", ("transformer.wte.weight",)),
            WeightMap(0, "position_embeddings.weight", ("transformer.wpe.weight",))]
    for i in range(1, L + 1):
        p = f"transformer.h.{i - 1}."
        for ours, hf in (("input_norm", "ln_1"), ("post_attention_norm", "ln_2")):
            rows += [WeightMap(i, f"{ours}.weight", (p + hf + ".weight",)),
                     WeightMap(i, f"{ours}.bias", (p + hf + ".bias",))]
        for ours, hf in (("attention.qkv", "attn.c_attn"), ("attention.out_proj", "attn.c_proj"),
                         ("mlp.fc_in", "mlp.c_fc"), ("mlp.fc_out", "mlp.c_proj")):
            rows += [WeightMap(i, f"{ours}.weight", (p + hf + ".weight",), "transpose"),
                     WeightMap(i, f"{ours}.bias", (p + hf + ".bias",))]
    rows += [WeightMap(L + 1, "norm.weight", ("transformer.ln_f.weight",)),
             WeightMap(L + 1, "norm.bias", ("transformer.ln_f.bias",))]
    if not cfg.tie_word_embeddings:
        rows.append(WeightMap(L + 2, "weight", ("lm_head.weight",)))
    return rows
