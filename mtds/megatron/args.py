"""Megatron-LM's model arguments <-> ModelConfig.

A Megatron-LM torch_dist checkpoint carries the run's ``args`` (an argparse.Namespace) in its common state
(common.py: ``common.pt``, or inside the DCP files from 0.17 on); checkpoints saved by Megatron-core alone
may not. The converter merges the two sources: an argument in
the checkpoint and the same flag given on the command line must agree (else one error naming the
field), a field in neither takes Megatron-LM's default, and the few without a default must come from
somewhere. Names are Megatron-LM's (``--num-query-groups`` is ``num_query_groups``).
"""
from __future__ import annotations

from typing import Any, Mapping

from mtds.model.config import ModelConfig

from mtds.megatron.errors import MegatronCheckpointError

# Megatron-LM's defaults for what a model needs, as its parse_args sets them (megatron/training/arguments.py
# and, from 0.17 on, the TransformerConfig fields it turns into flags); None: no default. A flags-only
# conversion is "a Megatron-LM run with these flags": every flag not given takes this value, then the
# derivations of validate_args (megatron_lm_args). tests/test_megatron_lm.py checks the table against
# Megatron-LM's own parser.
DEFAULTS: dict[str, Any] = {
    "num_layers": None, "hidden_size": None, "num_attention_heads": None, "max_position_embeddings": None,
    "ffn_hidden_size": None, "kv_channels": None, "group_query_attention": False, "num_query_groups": 1,
    "position_embedding_type": "learned_absolute", "rotary_base": 10000, "rotary_percent": 1.0,
    "normalization": "LayerNorm", "norm_epsilon": 1e-5, "swiglu": False, "openai_gelu": False,
    # on unless --no-bias-gelu-fusion: Megatron's fused bias-GELU kernel, the tanh approximation
    "bias_gelu_fusion": True,
    "untie_embeddings_and_output_weights": False, "add_bias_linear": True, "add_qkv_bias": False,
    "hidden_dropout": 0.1, "attention_dropout": 0.1, "init_method_std": 0.02, "make_vocab_size_divisible_by": 128,
}
# Megatron-LM 0.17+ stores some flags under TransformerConfig's field names: --norm-epsilon as
# layernorm_epsilon, --apply-layernorm-1p as layernorm_zero_centered_gamma. Saved args are read under
# either name.
ALIASES = {"layernorm_epsilon": "norm_epsilon", "layernorm_zero_centered_gamma": "apply_layernorm_1p"}
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")

# Megatron-LM switches of models mtds does not build: refused when set (their Megatron-LM default is off).
UNSUPPORTED = ("num_experts", "qk_layernorm", "apply_layernorm_1p", "apply_residual_connection_post_layernorm",
               "use_rope_scaling", "rotary_interleaved", "squared_relu", "quick_gelu", "window_size",
               "multi_latent_attention", "attention_output_gate", "rotary_seq_len_interpolation_factor")
POSITIONS = {"learned_absolute": "learned", "rope": "rotary"}
NORMS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}


def merge_args(saved: Mapping[str, Any] | None, flags: Mapping[str, Any]) -> dict[str, Any]:
    """The model's arguments: ``saved`` (the checkpoint's, may be None) with ``flags`` (given ones only:
    value not None) on top; a flag that contradicts the checkpoint is an error naming the field."""
    saved = dict(saved or {})
    for alias, name in ALIASES.items():
        if saved.get(name) is None and alias in saved:
            saved[name] = saved[alias]
    for name, value in flags.items():
        if value is None or name not in saved or saved[name] is None:
            continue
        if saved[name] != value:
            raise MegatronCheckpointError(f"--{name.replace('_', '-')} {value!r} contradicts the checkpoint's "
                                          f"args.{name} = {saved[name]!r}")
    merged = megatron_lm_args({**{k: v for k, v in saved.items() if k in DEFAULTS or k in UNSUPPORTED},
                               **{k: v for k, v in flags.items() if v is not None}})
    for name in (*REQUIRED, "padded_vocab_size"):
        if merged.get(name) is None and name in saved:
            merged[name] = saved[name]
    return merged


def megatron_lm_args(given: Mapping[str, Any]) -> dict[str, Any]:
    """The model's fields of a Megatron-LM run given ``given``: DEFAULTS for the rest, then what
    validate_args derives (the bias switches kept in sync, the fused bias-GELU off without biases, kv
    channels and the FFN width from the hidden size where the weights do not say)."""
    args = {**DEFAULTS, **{k: v for k, v in given.items() if v is not None or k not in DEFAULTS}}
    if args["add_bias_linear"]:
        args["add_qkv_bias"] = True
    else:
        args["bias_gelu_fusion"] = False
    if args["kv_channels"] is None and args["hidden_size"] and args["num_attention_heads"]:
        args["kv_channels"] = args["hidden_size"] // args["num_attention_heads"]
    return args


def config_from_args(args: Mapping[str, Any], *, vocab_size: int, ffn_hidden_size: int | None = None) -> ModelConfig:
    """ModelConfig of a Megatron model; ``vocab_size``: rows of its (padded) embedding, which the logits
    span; ``ffn_hidden_size``: read off the weights when the arguments do not say."""
    missing = [n for n in REQUIRED if args.get(n) is None]
    if missing:
        flags = ", ".join("--" + n.replace("_", "-") for n in missing)
        raise MegatronCheckpointError(f"the checkpoint carries no args.{missing[0]} (no args in its common state?): "
                                      f"pass {flags}")
    for name in UNSUPPORTED:
        if args.get(name) not in (None, False, 1, 1.0):
            raise MegatronCheckpointError(f"args.{name} = {args[name]!r} is not supported (mtds builds dense "
                                          f"GPT-2 and Llama-style models)")
    position, norm = args["position_embedding_type"], args["normalization"]
    if position not in POSITIONS:
        raise MegatronCheckpointError(f"args.position_embedding_type = {position!r} is not supported; "
                                      f"supported: {', '.join(POSITIONS)}")
    if norm not in NORMS:
        raise MegatronCheckpointError(f"args.normalization = {norm!r} is not supported; supported: {', '.join(NORMS)}")
    heads = args["num_attention_heads"]
    ffn = args["ffn_hidden_size"] or ffn_hidden_size or 4 * args["hidden_size"]
    # The fused bias-GELU kernel Megatron runs when bias_gelu_fusion is on (megatron/core/fusions/
    # fused_bias_gelu.py, chosen in transformer/mlp.py) is the tanh approximation, whatever the activation.
    fused_gelu = args["bias_gelu_fusion"] and args["add_bias_linear"]
    activation = "swiglu" if args["swiglu"] else "gelu_tanh" if args["openai_gelu"] or fused_gelu else "gelu"
    try:
        return ModelConfig(
            vocab_size=vocab_size, hidden_size=args["hidden_size"], num_layers=args["num_layers"], num_heads=heads,
            num_kv_heads=args["num_query_groups"] if args["group_query_attention"] else heads,
            kv_channels=args["kv_channels"], ffn_hidden_size=ffn,
            max_position_embeddings=args["max_position_embeddings"], position_embedding=POSITIONS[position],
            rotary_percent=float(args["rotary_percent"]), rotary_base=float(args["rotary_base"]),
            normalization=NORMS[norm], norm_eps=float(args["norm_epsilon"]), activation=activation,
            # Megatron's linear_qkv has a bias when either switch is on (megatron.core.transformer.attention)
            qkv_bias=bool(args["add_bias_linear"] or args["add_qkv_bias"]), linear_bias=bool(args["add_bias_linear"]),
            tie_word_embeddings=not args["untie_embeddings_and_output_weights"],
            hidden_dropout=float(args["hidden_dropout"]), attention_dropout=float(args["attention_dropout"]),
            init_std=float(args["init_method_std"]), make_vocab_size_divisible_by=args["make_vocab_size_divisible_by"],
            architecture="llama" if position == "rope" else "gpt2")
    except ValueError as err:
        raise MegatronCheckpointError(f"the Megatron arguments describe no valid model: {err}") from None


def args_from_config(cfg: ModelConfig) -> dict[str, Any]:
    """Megatron-LM's arguments for ``cfg``; refuses what Megatron-LM cannot express."""
    refused = {"rope_scaling": cfg.rope_scaling is not None, "qk_norm": cfg.qk_norm,
               "sliding_window": cfg.sliding_window is not None, "parallel_residual": cfg.parallel_residual,
               "out_proj_bias": cfg.has_out_proj_bias != cfg.linear_bias,
               # Megatron's add_bias_linear gives linear_qkv a bias too
               "qkv_bias": cfg.linear_bias and not cfg.qkv_bias}
    for field, bad in refused.items():
        if bad:
            raise MegatronCheckpointError(f"cannot export to Megatron: ModelConfig.{field} = "
                                          f"{getattr(cfg, field)!r} has no Megatron-LM equivalent")
    gqa = cfg.kv_heads != cfg.num_heads
    return {
        "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
        "ffn_hidden_size": cfg.ffn_size, "kv_channels": cfg.head_dim, "group_query_attention": gqa,
        "num_query_groups": cfg.kv_heads if gqa else None, "max_position_embeddings": cfg.max_position_embeddings,
        "position_embedding_type": {v: k for k, v in POSITIONS.items()}[cfg.position_embedding],
        "rotary_base": cfg.rotary_base, "rotary_percent": cfg.rotary_percent,
        "normalization": {v: k for k, v in NORMS.items()}[cfg.normalization], "norm_epsilon": cfg.norm_eps,
        "layernorm_epsilon": cfg.norm_eps,     # --norm-epsilon's name in Megatron-LM 0.17+
        "swiglu": cfg.activation == "swiglu", "openai_gelu": cfg.activation == "gelu_tanh",
        "bias_gelu_fusion": False,         # on, exact GELU would run as its tanh approximation
        "untie_embeddings_and_output_weights": not cfg.tie_word_embeddings, "add_bias_linear": cfg.linear_bias,
        "add_qkv_bias": cfg.qkv_bias and not cfg.linear_bias, "hidden_dropout": cfg.hidden_dropout,
        "attention_dropout": cfg.attention_dropout, "init_method_std": cfg.init_std,
        "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by, "padded_vocab_size": cfg.vocab_size,
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "ckpt_format": "torch_dist",
    }
