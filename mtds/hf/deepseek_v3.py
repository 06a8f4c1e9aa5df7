"""DeepSeek-V3 (transformers DeepseekV3ForCausalLM; Kimi-K2 and GLM-4.5's router are the same design) <-> mtds:
multi-head latent attention (mtds.model.latent_attention) and DeepSeekMoE (mtds.model.router's sigmoid routing
with ``e_score_correction_bias`` for the choice, group-limited top-k, ``norm_topk_prob``,
``routed_scaling_factor``; ``n_shared_experts`` as one always-on shared expert of ``n_shared_experts`` x
``moe_intermediate_size``); the first ``first_k_dense_replace`` blocks dense. transformers adds no load-balancing
loss for it (router_aux_loss_coef 0); the bias moves only with ``--moe-router-bias-update-rate`` in training.

Refused, one line each: multi-token prediction layers (``num_nextn_predict_layers`` > 0; transformers drops
them too: set it to 0 to train the model without them), ``attention_bias``, other activations, a key/value head
count other than the query heads', DeepSeek-V3.2's sparse attention indexer (``deepseek_v32``, another
model_type).
"""
from __future__ import annotations

from typing import Any

from mtds.model.config import ModelConfig

from mtds.hf import llama_like
from mtds.hf.common import read_rope, require, require_export, rope_to_hf
from mtds.hf.table import WeightMap

MODEL_TYPE = "deepseek_v3"
HF_ARCHITECTURE = "DeepseekV3ForCausalLM"
BASE_PREFIX = "model."
# DeepSeek-V3's files hold its multi-token prediction layer as model.layers.61 (after the 61 blocks): skipped on
# load as transformers skips it (a model whose block 61 is real would miss that block's weights: refused on load)
IGNORED_KEYS = (*llama_like.IGNORED_KEYS, r"(^|\.)layers\.61\.")
KEY_ALIASES: dict[str, tuple[str, ...]] = {}
DEFAULTS = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
            "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
            "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "rope_interleave": True}


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    def get(key: str) -> Any:
        return d[key] if d.get(key) is not None else DEFAULTS[key]

    mtp = d.get("num_nextn_predict_layers", d.get("num_mtp_layers")) or 0
    require(mtp == 0, f"{MODEL_TYPE}: num_nextn_predict_layers {mtp} (multi-token prediction layers) is not "
                      f"supported; transformers drops them too: set it to 0 to train the model without them")
    # the Hub's config.json keys of DeepSeek's own code, which transformers keeps but does not read: only the
    # values transformers' model computes are accepted
    for key, built in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        require(d.get(key, built) == built, f"{MODEL_TYPE}: {key} {d.get(key)!r} is not supported (only {built!r}, "
                                            f"as transformers computes it)")
    require(not d.get("attention_bias", False), f"{MODEL_TYPE}: attention_bias true is not supported (only false, "
                                                f"as the released models)")
    act = d.get("hidden_act") or "silu"
    require(act == "silu", f"{MODEL_TYPE}: hidden_act {act!r} is not supported; supported: silu (SwiGLU)")
    heads = get("num_attention_heads")
    kv_heads = d.get("num_key_value_heads") or heads
    require(kv_heads == heads, f"{MODEL_TYPE}: num_key_value_heads {kv_heads} is not supported (only "
                               f"num_attention_heads {heads}: latent attention expands the keys per head)")
    layers, experts = get("num_hidden_layers"), d.get("n_routed_experts") or d.get("num_local_experts") or \
        DEFAULTS["n_routed_experts"]
    dense = get("first_k_dense_replace")
    require(0 <= dense < layers, f"{MODEL_TYPE}: first_k_dense_replace {dense} must be in 0..{layers - 1} (at "
                                 f"least one MoE block)")
    groups = d.get("n_group") if "n_group" in d else DEFAULTS["n_group"]
    group_topk = d.get("topk_group") if "topk_group" in d else DEFAULTS["topk_group"]
    require((groups is None) == (group_topk is None) and (groups is None or groups >= 1),
            f"{MODEL_TYPE}: n_group {groups} and topk_group {group_topk} must both be set (>= 1)")
    rope = read_rope(d, MODEL_TYPE, default_theta=10000.0, default_percent=1.0, scalings=("yarn",))
    moe_ffn, shared = get("moe_intermediate_size"), get("n_shared_experts")
    require(shared >= 1, f"{MODEL_TYPE}: n_shared_experts {shared} is not supported (only >= 1)")
    q_lora = d.get("q_lora_rank") if "q_lora_rank" in d else DEFAULTS["q_lora_rank"]
    return ModelConfig(
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_layers=layers, num_heads=heads,
        num_kv_heads=heads, ffn_hidden_size=get("intermediate_size"),
        max_position_embeddings=get("max_position_embeddings"), position_embedding="rotary", rotary_percent=1.0,
        rotary_base=rope.theta, rope_scaling=rope.scaling, rope_scaling_params=rope.params, normalization="rmsnorm",
        norm_eps=d.get("rms_norm_eps", 1e-6), activation="swiglu", qkv_bias=False, linear_bias=False,
        out_proj_bias=False, parallel_residual=False, tie_word_embeddings=bool(get("tie_word_embeddings")),
        hidden_dropout=0.0, attention_dropout=float(d.get("attention_dropout") or 0.0),
        init_std=d.get("initializer_range", 0.02), architecture=MODEL_TYPE,
        num_experts=experts, moe_top_k=get("num_experts_per_tok"), moe_ffn_hidden_size=moe_ffn,
        norm_topk_prob=bool(get("norm_topk_prob")), router_aux_loss_coef=0.0, mlp_only_layers=tuple(range(dense)),
        moe_shared_expert_intermediate_size=shared * moe_ffn, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_num_groups=groups, moe_router_group_topk=group_topk,
        moe_router_topk_scaling_factor=float(get("routed_scaling_factor")),
        multi_latent_attention=True, q_lora_rank=q_lora, kv_lora_rank=get("kv_lora_rank"),
        qk_head_dim=get("qk_nope_head_dim"), qk_pos_emb_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"), rotary_interleaved=bool(get("rope_interleave")))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    dense = len(cfg.mlp_only_layers)
    require_export(cfg, MODEL_TYPE, multi_latent_attention=True, moe_router_score_function="sigmoid",
                   moe_router_enable_expert_bias=True, decoder_sparse_step=1,
                   moe_shared_expert_gate=False, qkv_bias=False, linear_bias=False, has_out_proj_bias=False,
                   normalization="rmsnorm", activation="swiglu", rotary_percent=1.0)
    require(cfg.mlp_only_layers == tuple(range(dense)), f"cannot export to {MODEL_TYPE}: its dense blocks are the "
                                                        f"first ones, this model's are {list(cfg.mlp_only_layers)}")
    shared = cfg.moe_shared_expert_intermediate_size or 0
    require(shared and shared % cfg.moe_ffn_size == 0,
            f"cannot export to {MODEL_TYPE}: the shared expert width {shared} is not a multiple of the expert width "
            f"{cfg.moe_ffn_size} (n_shared_experts x moe_intermediate_size)")
    return {"model_type": MODEL_TYPE, "architectures": [HF_ARCHITECTURE], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
            "moe_intermediate_size": cfg.moe_ffn_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_heads, "n_shared_experts": shared // cfg.moe_ffn_size,
            "n_routed_experts": cfg.num_experts, "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
            "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank,
            "qk_rope_head_dim": cfg.qk_pos_emb_head_dim,
            "v_head_dim": cfg.v_head_dim, "qk_nope_head_dim": cfg.qk_head_dim, "n_group": cfg.moe_router_num_groups,
            "topk_group": cfg.moe_router_group_topk, "num_experts_per_tok": cfg.moe_top_k,
            "first_k_dense_replace": dense, "norm_topk_prob": cfg.norm_topk_prob, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_word_embeddings, "rope_interleave": cfg.rotary_interleaved,
            "attention_bias": False, "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.init_std,
            "num_nextn_predict_layers": 0, "num_mtp_layers": 0, **rope_to_hf(cfg)}


def weight_table(cfg: ModelConfig) -> list[WeightMap]:
    rows = [WeightMap(0, "word_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(1, cfg.num_layers + 1):
        p = f"model.layers.{i - 1}."
        a = p + "self_attn."
        rows += [WeightMap(i, "input_norm.weight", (p + "input_layernorm.weight",)),
                 WeightMap(i, "post_attention_norm.weight", (p + "post_attention_layernorm.weight",))]
        names = ["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
        names += ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
        rows += [WeightMap(i, f"attention.{n}.weight", (a + f"{n}.weight",)) for n in names]
        if cfg.is_moe_layer(i):
            rows += llama_like.moe_rows(cfg, i, p)
            continue
        rows += [WeightMap(i, "mlp.fc_in.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "concat",
                           sizes=(cfg.ffn_size, cfg.ffn_size)),
                 WeightMap(i, "mlp.fc_out.weight", (p + "mlp.down_proj.weight",))]
    rows.append(WeightMap(cfg.num_layers + 1, "norm.weight", ("model.norm.weight",)))
    if not cfg.tie_word_embeddings:
        rows.append(WeightMap(cfg.num_layers + 2, "weight", ("lm_head.weight",)))
    return rows
