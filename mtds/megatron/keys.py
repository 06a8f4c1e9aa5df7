"""Megatron-core's sharded-state keys <-> mtds's full logical tensors (global layer, name).

What a torch_dist checkpoint stores, per key, is the *global* tensor: every TP shard at its offset, and
the transformer layers stacked on a leading axis of size num_layers (``decoder.layers.<...>`` is [L, ...],
``TransformerLayer.sharded_state_dict`` prepends that axis). Megatron-core names the local spec's norms as
Transformer Engine fuses them (``linear_qkv.layer_norm_weight`` for ``input_layernorm.weight``), so both
specs share one set of keys; older checkpoints with the unfused names are read too.

Two tensors differ in layout from mtds's (megatron/core/transformer/attention.py, mlp.py):
- linear_qkv: rows grouped per query group g: [q heads of g (num_heads/groups of them), k_g, v_g], groups in
  order; TP ranks own whole groups, so the global tensor is the same at every t. mtds: [all q | all k | all v].
- linear_fc1 with SwiGLU: Megatron's sharding factory (apply_swiglu_sharded_factory) stores each rank's gate
  half and up half at separate offsets, so the global tensor is [gate | up]: mtds's order already.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from mtds.model.config import ModelConfig

from mtds.megatron.errors import MegatronCheckpointError

LAYERS = "decoder.layers."
# The model's keys start with these; the rest of a Megatron-LM checkpoint (optimizer.*, rng_state, ...) is
# training state the conversion leaves behind.
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
# Unfused norm names (older Megatron-core, or a spec without Transformer Engine's naming) -> the fused ones.
ALIASES = {LAYERS + "input_layernorm.weight": LAYERS + "self_attention.linear_qkv.layer_norm_weight",
           LAYERS + "input_layernorm.bias": LAYERS + "self_attention.linear_qkv.layer_norm_bias",
           LAYERS + "pre_mlp_layernorm.weight": LAYERS + "mlp.linear_fc1.layer_norm_weight",
           LAYERS + "pre_mlp_layernorm.bias": LAYERS + "mlp.linear_fc1.layer_norm_bias"}


@dataclass(frozen=True)
class Row:
    key: str            # Megatron key (blocks: stacked over layers)
    layer: int | None   # mtds global layer; None: one per block (1..L), stacked
    name: str           # mtds name inside that layer
    qkv: bool = False   # rows interleaved per query group (see the module docstring)


def table(cfg: ModelConfig) -> list[Row]:
    """Every tensor of the Megatron model for ``cfg``, in Megatron's key names."""
    norm = ("weight", "bias") if cfg.normalization == "layernorm" else ("weight",)
    bias = ("weight", "bias") if cfg.linear_bias else ("weight",)
    qkv = ("weight", "bias") if cfg.qkv_bias else ("weight",)
    rows = [Row("embedding.word_embeddings.weight", 0, "word_embeddings.weight")]
    if cfg.position_embedding == "learned":
        rows.append(Row("embedding.position_embeddings.weight", 0, "position_embeddings.weight"))
    rows += [Row(f"{LAYERS}self_attention.linear_qkv.layer_norm_{n}", None, f"input_norm.{n}") for n in norm]
    rows += [Row(f"{LAYERS}self_attention.linear_qkv.{n}", None, f"attention.qkv.{n}", qkv=True) for n in qkv]
    rows += [Row(f"{LAYERS}self_attention.linear_proj.{n}", None, f"attention.out_proj.{n}") for n in bias]
    rows += [Row(f"{LAYERS}mlp.linear_fc1.layer_norm_{n}", None, f"post_attention_norm.{n}") for n in norm]
    rows += [Row(f"{LAYERS}mlp.linear_fc1.{n}", None, f"mlp.fc_in.{n}") for n in bias]
    rows += [Row(f"{LAYERS}mlp.linear_fc2.{n}", None, f"mlp.fc_out.{n}") for n in bias]
    rows += [Row(f"decoder.final_layernorm.{n}", cfg.num_layers + 1, f"norm.{n}") for n in norm]
    if not cfg.tie_word_embeddings:      # tied: Megatron saves the embedding only (output_layer shares it)
        rows.append(Row("output_layer.weight", cfg.num_layers + 2, "weight"))
    return rows


def qkv_to_mtds(cfg: ModelConfig, t: torch.Tensor) -> torch.Tensor:
    """[groups, (q per group + 2), d, ...] -> [q | k | v]."""
    groups, d = cfg.kv_heads, cfg.head_dim
    per = cfg.num_heads // groups
    w = t.reshape(groups, per + 2, d, *t.shape[1:])
    q = w[:, :per].reshape(cfg.num_heads * d, *t.shape[1:])
    return torch.cat([q, w[:, per].reshape(groups * d, *t.shape[1:]), w[:, per + 1].reshape(groups * d, *t.shape[1:])])


def qkv_to_megatron(cfg: ModelConfig, t: torch.Tensor) -> torch.Tensor:
    groups, d = cfg.kv_heads, cfg.head_dim
    per = cfg.num_heads // groups
    q, k, v = t.split([cfg.num_heads * d, groups * d, groups * d])
    rest = t.shape[1:]
    w = torch.cat([q.reshape(groups, per, d, *rest), k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)],
                  dim=1)
    return w.reshape(t.shape).contiguous()


def resolve(available: Mapping[str, tuple[int, ...]], key: str) -> str:
    """The stored name of ``key`` (itself, or its unfused alias)."""
    if key in available:
        return key
    for old, new in ALIASES.items():
        if new == key and old in available:
            return old
    raise MegatronCheckpointError(f"the checkpoint has no tensor {key!r}: the model it holds differs from the "
                                  f"arguments (check --swiglu, --normalization, --add-bias-linear, "
                                  f"--untie-embeddings-and-output-weights, --position-embedding-type)")


def to_layers(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(global layer, {mtds name: full tensor}) in layer order from Megatron's global tensors (by resolved key)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for row in table(cfg):
        t = tensors[row.key]
        pieces = {row.layer: t} if row.layer is not None else {i + 1: t[i] for i in range(cfg.num_layers)}
        for layer, piece in pieces.items():
            out.setdefault(layer, {})[row.name] = (qkv_to_mtds(cfg, piece) if row.qkv else piece).contiguous()
    yield from sorted(out.items())


def from_layers(cfg: ModelConfig, layers: Iterator[tuple[int, Mapping[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Megatron's global tensors (blocks stacked) from full mtds layers; holds the whole model."""
    full = dict(layers)
    state = {}
    for row in table(cfg):
        if row.layer is not None:
            state[row.key] = full[row.layer][row.name].contiguous()
            continue
        blocks = [full[i][row.name] for i in range(1, cfg.num_layers + 1)]
        state[row.key] = torch.stack([qkv_to_megatron(cfg, b) if row.qkv else b for b in blocks])
    return state


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{key: global shape} of the Megatron model for cfg (vocabulary rows: cfg.vocab_size)."""
    h, L, f = cfg.hidden_size, cfg.num_layers, cfg.ffn_size
    fc1 = 2 * f if cfg.activation == "swiglu" else f
    block = {"layer_norm_weight": (h,), "layer_norm_bias": (h,), "linear_qkv.weight": (cfg.qkv_size, h),
             "linear_qkv.bias": (cfg.qkv_size,), "linear_proj.weight": (h, cfg.num_heads * cfg.head_dim),
             "linear_proj.bias": (h,), "linear_fc1.weight": (fc1, h), "linear_fc1.bias": (fc1,),
             "linear_fc2.weight": (h, f), "linear_fc2.bias": (h,)}
    shapes = {}
    for row in table(cfg):
        if row.layer is None:
            tail = row.key.split(".")[-2:]
            name = ".".join(tail) if not tail[-1].startswith("layer_norm") else tail[-1]
            shapes[row.key] = (L, *block[name])
        elif row.layer == 0:
            shapes[row.key] = (cfg.vocab_size if "word" in row.key else cfg.max_position_embeddings, h)
        elif row.layer == cfg.num_layers + 1:
            shapes[row.key] = (h,)
        else:
            shapes[row.key] = (cfg.vocab_size, h)
    return shapes


def check_keys(cfg: ModelConfig, available: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """{key: stored name} after checking every tensor's presence and shape, and that nothing is left over."""
    stored = {}
    for key, shape in expected_shapes(cfg).items():
        stored[key] = resolve(available, key)
        have = tuple(available[stored[key]])
        if have != shape:
            raise MegatronCheckpointError(f"{key} has shape {list(have)}, the arguments give {list(shape)} "
                                          f"(check --num-attention-heads, --num-query-groups, --kv-channels, "
                                          f"--ffn-hidden-size, --max-position-embeddings)")
    extra = sorted(k for k in available if k.startswith(MODEL_PREFIXES) and k not in stored.values()
                   and not k.endswith("_extra_state"))
    if extra:
        raise MegatronCheckpointError(f"{len(extra)} tensor(s) of the checkpoint have no place in the model the "
                                      f"arguments describe, e.g. {extra[:3]}")
    return stored
