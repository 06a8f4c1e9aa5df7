"""How every logical parameter of a GPT is split over tensor-parallel ranks, without building the model.

Checkpoint readers/writers and DeepSpeed's universal-checkpoint patterns need this for models far larger
than memory, so it is a table derived from ModelConfig alone. tests/test_reshard_spec.py checks it
against the attributes the tp layers put on real parameters (tensor_model_parallel, partition_dim,
partition_segments), which remain the ground truth.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mtds.model.config import ModelConfig
from mtds.tp import shard_rows, unshard_rows


@dataclass(frozen=True)
class Split:
    dim: int | None                       # None: replicated on every TP rank
    segments: tuple[int, ...] | None = None   # fused q|k|v or gate|up: each segment split separately
    vocab: bool = False                   # dim 0 is the vocabulary, zero-padded to cfg.padded_vocab_size(t)


REPLICATED = Split(None)


def layer_names(cfg: ModelConfig) -> dict[int, list[str]]:
    """{global layer: its parameter names} of the model mtds builds for cfg (0 embedding, 1..L blocks,
    L+1 final norm, L+2 the untied head), in the order the modules register them."""
    norm = ["weight", "bias"] if cfg.normalization == "layernorm" else ["weight"]
    linear = ["weight", "bias"] if cfg.linear_bias else ["weight"]
    qkv = ["weight", "bias"] if cfg.qkv_bias else ["weight"]
    out_proj = ["weight", "bias"] if cfg.has_out_proj_bias else ["weight"]
    qk_norm = [f"attention.{x}_norm.{n}" for x in "qk" for n in norm] if cfg.qk_norm else []
    # the sinks are the attention module's own parameter: listed before its submodules' (parameters() order)
    sinks = ["attention.sinks"] if cfg.attention_sinks else []
    attention = ([f"input_norm.{n}" for n in norm] + sinks + [f"attention.qkv.{n}" for n in qkv]
                 + [f"attention.out_proj.{n}" for n in out_proj] + qk_norm + [f"post_attention_norm.{n}" for n in norm])
    if cfg.multi_latent_attention:                                        # mtds.model.latent_attention
        mla = ["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
        mla += ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
        attention = (["input_norm.weight"] + [f"attention.{m}.weight" for m in mla] + ["post_attention_norm.weight"])
    dense = [f"mlp.{fc}.{n}" for fc in ("fc_in", "fc_out") for n in linear]
    moe = ["mlp.router.weight", "mlp.experts.gate_up", "mlp.experts.down"]   # mtds.model.moe
    if cfg.moe_router_enable_expert_bias:     # a persistent fp32 buffer, in the module's state like a weight
        moe.insert(1, "mlp.router.e_score_correction_bias")
    if cfg.linear_bias:                       # GPT-OSS's router and expert biases
        moe = ["mlp.router.weight", "mlp.router.bias", "mlp.experts.gate_up", "mlp.experts.down",
               "mlp.experts.gate_up_bias", "mlp.experts.down_bias"]
    if cfg.moe_shared_expert_intermediate_size is not None:               # mtds.model.shared_expert
        moe += ["mlp.shared_expert.fc_in.weight", "mlp.shared_expert.fc_out.weight"]
        moe += ["mlp.shared_expert.gate"] if cfg.moe_shared_expert_gate else []
    names = {0: ["word_embeddings.weight"] + (["position_embeddings.weight"] if cfg.position_embedding == "learned"
                                              else [])}
    names.update({i: attention + (moe if cfg.is_moe_layer(i) else dense) for i in range(1, cfg.num_layers + 1)})
    names[cfg.num_layers + 1] = [f"norm.{n}" for n in norm]
    if not cfg.tie_word_embeddings:
        names[cfg.num_layers + 2] = ["weight"]
    return names


def split_of(cfg: ModelConfig, layer: int, name: str) -> Split:
    """Split of parameter ``name`` inside global layer ``layer`` (0 emb, 1..L blocks, L+1 norm, L+2 head)."""
    L = cfg.num_layers
    if layer == 0:
        return Split(0, vocab=True) if name == "word_embeddings.weight" else REPLICATED
    if layer == L + 2:
        return Split(0, vocab=True)
    if layer == L + 1 or "norm" in name or name.endswith(("out_proj.bias", "fc_out.bias")):
        return REPLICATED
    if name in ("mlp.router.bias", "mlp.experts.down_bias"):
        return REPLICATED                 # the down bias is added once, after the experts' TP all-reduce
    if name == "mlp.experts.gate_up_bias":    # [E, 2F]: split like gate_up's rows
        return Split(1, (cfg.moe_ffn_size, cfg.moe_ffn_size))
    if name in ("attention.q_proj.weight", "attention.q_b_proj.weight", "attention.kv_b_proj.weight",
                "attention.sinks"):
        return Split(0)                   # latent attention's per-head up-projections (heads split over TP)
    if name == "attention.o_proj.weight":
        return Split(1)
    if name in ("attention.q_a_proj.weight", "attention.kv_a_proj_with_mqa.weight"):
        return REPLICATED                 # its down-projections, whole on every TP rank
    if name.startswith("attention.qkv."):
        d = cfg.head_dim
        return Split(0, (cfg.num_heads * d, cfg.kv_heads * d, cfg.kv_heads * d))
    if name.startswith("mlp.fc_in."):
        return Split(0, (cfg.ffn_size, cfg.ffn_size) if cfg.activation == "swiglu" else None)
    if name == "mlp.shared_expert.fc_in.weight":
        width = cfg.moe_shared_expert_intermediate_size
        return Split(0, (width, width))
    if name in ("attention.out_proj.weight", "mlp.fc_out.weight", "mlp.shared_expert.fc_out.weight"):
        return Split(1)
    if name in ("mlp.router.weight", "mlp.router.e_score_correction_bias", "mlp.shared_expert.gate"):
        return REPLICATED
    if name == "mlp.experts.gate_up":     # [E, 2F, h]: each expert's gate|up split over TP
        return Split(1, (cfg.moe_ffn_size, cfg.moe_ffn_size))
    if name == "mlp.experts.down":        # [E, h, F]
        return Split(2)
    raise KeyError(f"no tensor-parallel split known for layer {layer} parameter {name!r}")


def shard(cfg: ModelConfig, layer: int, name: str, full: torch.Tensor, t: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s piece (of t) of the full, unpadded logical tensor."""
    s = split_of(cfg, layer, name)
    if s.dim is None or t == 1 and not s.vocab:
        return full
    if s.vocab and full.shape[0] < cfg.padded_vocab_size(t):
        pad = full.new_zeros((cfg.padded_vocab_size(t) - full.shape[0], *full.shape[1:]))
        full = torch.cat([full, pad], dim=0)
    return shard_rows(full, s.dim, t, rank, s.segments)


def unshard(cfg: ModelConfig, layer: int, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Full unpadded logical tensor from every TP rank's piece (rank order)."""
    s = split_of(cfg, layer, name)
    if s.dim is None:
        return pieces[0]
    full = unshard_rows(pieces, s.dim, s.segments)
    return full[:cfg.vocab_size] if s.vocab else full


def local_shape(cfg: ModelConfig, layer: int, name: str, full_shape: tuple[int, ...], t: int) -> tuple[int, ...]:
    s = split_of(cfg, layer, name)
    shape = list(full_shape)
    if s.vocab:
        shape[0] = cfg.padded_vocab_size(t)
    if s.dim is not None:
        shape[s.dim] //= t
    return tuple(shape)
