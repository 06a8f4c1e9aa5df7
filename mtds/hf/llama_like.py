"""What the Llama-shaped HF families share (Llama, Qwen2, Qwen3, Mistral): RMSNorm, SwiGLU, RoPE with
its trainable scalings, separate q/k/v and gate/up projections, and one weight table for all of them.

Each family's adapter says what differs (biases, q/k norm, sliding window, head_dim default) and
refuses what it cannot express; this module reads and writes the rest. We fuse q/k/v and gate/up
([q | k | v], [gate | up]) so one ColumnParallelLinear with output_segments serves each, giving every
rank whole query and key/value heads (grouped-query attention: t must divide num_key_value_heads).
"""
from __future__ import annotations

from typing import Any

from mtds.model.config import ROPE_SCALINGS, ModelConfig

from mtds.hf.common import read_rope, require, require_export, rope_to_hf
from mtds.hf.table import WeightMap

IGNORED_KEYS = (r"rotary_emb\.inv_freq$",)


def config_from_hf(d: dict[str, Any], arch: str, defaults: dict[str, Any], **family: Any) -> ModelConfig:
    """ModelConfig of a Llama-shaped HF config; ``defaults``: the HF class's defaults for absent keys
    (vocab_size, hidden_size, ...); ``family``: the ModelConfig fields the adapter decided (biases,
    qk_norm, sliding_window, kv_channels)."""
    def get(key: str) -> Any:
        return d[key] if d.get(key) is not None else defaults.get(key)

    act = get("hidden_act") or "silu"
    require(act == "silu", f"{arch}: hidden_act {act!r} is not supported; supported: silu (SwiGLU)")
    rope = read_rope(d, arch, default_theta=10000.0, default_percent=1.0, scalings=ROPE_SCALINGS)
    require(rope.percent == 1.0, f"{arch}: partial_rotary_factor {rope.percent} is not supported (only 1.0)")
    heads = get("num_attention_heads")
    return ModelConfig(
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_layers=get("num_hidden_layers"),
        num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads,
        ffn_hidden_size=get("intermediate_size"), max_position_embeddings=get("max_position_embeddings"),
        position_embedding="rotary", rotary_percent=1.0, rotary_base=rope.theta, rope_scaling=rope.scaling,
        rope_scaling_params=rope.params, normalization="rmsnorm", norm_eps=d.get("rms_norm_eps", 1e-6),
        activation="swiglu", parallel_residual=False, tie_word_embeddings=bool(get("tie_word_embeddings")),
        hidden_dropout=0.0, attention_dropout=float(d.get("attention_dropout", 0.0)),
        init_std=d.get("initializer_range", 0.02), architecture=arch, **family)


def config_to_hf(cfg: ModelConfig, arch: str, hf_architecture: str) -> dict[str, Any]:
    """The keys every Llama-shaped config.json has; the adapter adds its own (biases, window)."""
    require_export(cfg, arch, position_embedding="rotary", rotary_percent=1.0, normalization="rmsnorm",
                   activation="swiglu", parallel_residual=False, hidden_dropout=0.0)
    return {"model_type": arch, "architectures": [hf_architecture], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_size, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_word_embeddings, "attention_dropout": cfg.attention_dropout,
            "initializer_range": cfg.init_std, **rope_to_hf(cfg)}


# Where an MoE adapter keeps a block's router and experts, as transformers writes them to disk (and the Hub
# holds them): (router key, expert key with {e}, gate, up, down) under "model.layers.{i}.".
MOE_KEYS = {"mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.", "w1", "w3", "w2"),
            "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.", "gate_proj", "up_proj", "down_proj"),
            "qwen2_moe": ("mlp.gate.weight", "mlp.experts.{e}.", "gate_proj", "up_proj", "down_proj"),
            "deepseek_v3": ("mlp.gate.weight", "mlp.experts.{e}.", "gate_proj", "up_proj", "down_proj")}
# Where a family keeps the shared expert's MLP and its gate (None: ungated), under "model.layers.{i}.".
SHARED_EXPERT_KEYS = {"qwen2_moe": ("mlp.shared_expert.", "mlp.shared_expert_gate.weight"),
                      "deepseek_v3": ("mlp.shared_experts.", None)}


def fused_moe_rows(i: int, p: str) -> list[WeightMap]:
    """GPT-OSS's block: the router's weight and bias, and the experts as transformers' 3-D tensors (gate and up
    interleaved on gate_up_proj's last dim, [E, in, out]) with their biases."""
    return [WeightMap(i, "mlp.router.weight", (p + "mlp.router.weight",)),
            WeightMap(i, "mlp.router.bias", (p + "mlp.router.bias",)),
            WeightMap(i, "mlp.experts.gate_up", (p + "mlp.experts.gate_up_proj",), "interleaved_glu"),
            WeightMap(i, "mlp.experts.down", (p + "mlp.experts.down_proj",), "transpose"),
            WeightMap(i, "mlp.experts.gate_up_bias", (p + "mlp.experts.gate_up_proj_bias",), "interleaved_glu"),
            WeightMap(i, "mlp.experts.down_bias", (p + "mlp.experts.down_proj_bias",))]


def moe_rows(cfg: ModelConfig, i: int, p: str) -> list[WeightMap]:
    """An MoE block's rows: the router, and every expert's 2-D tensors stacked into mtds's [E, ...] ones
    (mtds.model.experts): gate|up concatenated per expert, down as is."""
    if cfg.architecture == "gpt_oss":
        return fused_moe_rows(i, p)
    router, expert, gate, up, down = MOE_KEYS[cfg.architecture]
    experts = [p + expert.format(e=e) for e in range(cfg.num_experts)]
    ffn = cfg.moe_ffn_size
    return [WeightMap(i, "mlp.router.weight", (p + router,)),
            WeightMap(i, "mlp.experts.gate_up", tuple(k + f"{w}.weight" for k in experts for w in (gate, up)),
                      "experts", sizes=(ffn, ffn)),
            WeightMap(i, "mlp.experts.down", tuple(k + f"{down}.weight" for k in experts), "experts",
                      sizes=(cfg.hidden_size,))] + expert_bias_rows(cfg, i, p) + shared_expert_rows(cfg, i, p)


def expert_bias_rows(cfg: ModelConfig, i: int, p: str) -> list[WeightMap]:
    """DeepSeek-V3's router bias (an fp32 buffer beside the router weight, mtds.model.router)."""
    if not cfg.moe_router_enable_expert_bias:
        return []
    return [WeightMap(i, "mlp.router.e_score_correction_bias", (p + "mlp.gate.e_score_correction_bias",))]


def shared_expert_rows(cfg: ModelConfig, i: int, p: str) -> list[WeightMap]:
    """The shared expert's gate|up and down (mtds.model.shared_expert), and its gate where it has one."""
    width = cfg.moe_shared_expert_intermediate_size
    if width is None:
        return []
    mlp, gate = SHARED_EXPERT_KEYS[cfg.architecture]
    rows = [WeightMap(i, "mlp.shared_expert.fc_in.weight", (p + mlp + "gate_proj.weight", p + mlp + "up_proj.weight"),
                      "concat", sizes=(width, width)),
            WeightMap(i, "mlp.shared_expert.fc_out.weight", (p + mlp + "down_proj.weight",))]
    if cfg.moe_shared_expert_gate:
        rows.append(WeightMap(i, "mlp.shared_expert.gate", (p + gate,)))
    return rows


def weight_table(cfg: ModelConfig) -> list[WeightMap]:
    L, d = cfg.num_layers, cfg.head_dim
    qkv_sizes = (cfg.num_heads * d, cfg.kv_heads * d, cfg.kv_heads * d)
    ffn_sizes = (cfg.ffn_size, cfg.ffn_size)

    def suffixes(bias: bool) -> tuple[str, ...]:
        return (".weight", ".bias") if bias else (".weight",)

    rows = [WeightMap(0, "word_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(1, L + 1):
        p = f"model.layers.{i - 1}."
        rows += [WeightMap(i, "input_norm.weight", (p + "input_layernorm.weight",)),
                 WeightMap(i, "post_attention_norm.weight", (p + "post_attention_layernorm.weight",))]
        rows += [WeightMap(i, "attention.qkv" + s, tuple(p + f"self_attn.{x}_proj" + s for x in "qkv"), "concat",
                           sizes=qkv_sizes) for s in suffixes(cfg.qkv_bias)]
        rows += [WeightMap(i, "attention.out_proj" + s, (p + "self_attn.o_proj" + s,))
                 for s in suffixes(cfg.has_out_proj_bias)]
        if cfg.qk_norm:
            rows += [WeightMap(i, f"attention.{x}_norm.weight", (p + f"self_attn.{x}_norm.weight",)) for x in "qk"]
        if cfg.attention_sinks:
            rows.append(WeightMap(i, "attention.sinks", (p + "self_attn.sinks",)))
        if cfg.is_moe_layer(i):
            rows += moe_rows(cfg, i, p)
            continue
        for s in suffixes(cfg.linear_bias):
            rows += [WeightMap(i, "mlp.fc_in" + s, (p + "mlp.gate_proj" + s, p + "mlp.up_proj" + s), "concat",
                               sizes=ffn_sizes),
                     WeightMap(i, "mlp.fc_out" + s, (p + "mlp.down_proj" + s,))]
    rows.append(WeightMap(L + 1, "norm.weight", ("model.norm.weight",)))
    if not cfg.tie_word_embeddings:
        rows.append(WeightMap(L + 2, "weight", ("lm_head.weight",)))
    return rows
