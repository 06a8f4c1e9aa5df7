"""The Megatron subcommands of ``mtds-convert`` (docs/megatron_checkpoints.md): Megatron-LM both ways,
Megatron-DeepSpeed in.

  mtds-convert megatron-to-mtds --load DIR --tp T --pp P --out DIR [model flags]
  mtds-convert mtds-to-megatron --ckpt DIR --out DIR [--iteration N]
  mtds-convert megatron-deepspeed-to-mtds --load DIR --tp T --pp P --out DIR

The model flags are Megatron-LM's own, spelled as in its training command; they are needed only where the
checkpoint carries no ``args`` (its common state: common.pt, or inside the DCP files from Megatron-core 0.17
on), and where it does, a flag that disagrees is an error. Flags not given take Megatron-LM's defaults.
"""
from __future__ import annotations

import argparse

# (flag, type or "on"/"off" for store_true / store_false switches, Megatron-LM arg name)
MODEL_FLAGS = (
    ("--num-layers", int, "num_layers"), ("--hidden-size", int, "hidden_size"),
    ("--num-attention-heads", int, "num_attention_heads"), ("--ffn-hidden-size", int, "ffn_hidden_size"),
    ("--kv-channels", int, "kv_channels"), ("--max-position-embeddings", int, "max_position_embeddings"),
    ("--group-query-attention", "on", "group_query_attention"), ("--num-query-groups", int, "num_query_groups"),
    ("--position-embedding-type", str, "position_embedding_type"), ("--rotary-base", int, "rotary_base"),
    ("--rotary-percent", float, "rotary_percent"), ("--normalization", str, "normalization"),
    ("--norm-epsilon", float, "norm_epsilon"), ("--swiglu", "on", "swiglu"), ("--openai-gelu", "on", "openai_gelu"),
    ("--bias-gelu-fusion", "on", "bias_gelu_fusion"), ("--no-bias-gelu-fusion", "off", "bias_gelu_fusion"),
    ("--untie-embeddings-and-output-weights", "on", "untie_embeddings_and_output_weights"),
    ("--add-bias-linear", "on", "add_bias_linear"), ("--disable-bias-linear", "off", "add_bias_linear"),
    ("--add-qkv-bias", "on", "add_qkv_bias"),
)


def _import_args(parser, dtypes, load_help: str) -> None:
    """The arguments both importers take: the source, the target layout, the output and the cast."""
    parser.add_argument("--load", required=True, metavar="DIR", help=load_help)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size of the target layout [1]")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages of the target layout [1]")
    parser.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to create (for --load)")
    parser.add_argument("--dtype", choices=sorted(dtypes), help="cast weights (default: as saved)")


def add_commands(sub, dtypes) -> None:
    a = sub.add_parser("megatron-to-mtds", help="Megatron-LM torch_dist checkpoint -> mtds checkpoint at (tp, pp)")
    _import_args(a, dtypes, "Megatron-LM --save folder (with latest_checkpointed_iteration.txt) or an iter_* folder")
    model = a.add_argument_group(
        "model (Megatron-LM's flags; needed only where the checkpoint carries no args: then every flag not "
        "given takes Megatron-LM's default, e.g. the tanh GELU of its bias-GELU fusion)")
    for flag, kind, dest in MODEL_FLAGS:
        if kind in ("on", "off"):
            model.add_argument(flag, dest=dest, action="store_const", const=kind == "on", default=None)
        else:
            model.add_argument(flag, dest=dest, type=kind, default=None)

    b = sub.add_parser("mtds-to-megatron", help="mtds checkpoint (any layout) -> Megatron-LM torch_dist checkpoint")
    b.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint root (with 'latest') or a tag folder")
    b.add_argument("--out", required=True, metavar="DIR", help="Megatron-LM checkpoint folder to create (its --load)")
    b.add_argument("--iteration", type=int, help="iteration to record (default: the checkpoint's step)")
    b.add_argument("--dtype", choices=sorted(dtypes), help="cast weights (default: as saved)")


def flags_of(args: argparse.Namespace) -> dict:
    """The model flags given on the command line (None: not given)."""
    return {dest: getattr(args, dest) for _, _, dest in MODEL_FLAGS}


def run_megatron_to_mtds(args, dtype) -> str:
    from mtds.megatron.convert import megatron_to_mtds
    return megatron_to_mtds(args.load, args.out, tp=args.tp, pp=args.pp, flags=flags_of(args), dtype=dtype)


def run_mtds_to_megatron(args, dtype) -> str:
    from mtds.megatron.convert import mtds_to_megatron
    return mtds_to_megatron(args.ckpt, args.out, iteration=args.iteration, dtype=dtype)


def add_deepspeed_command(sub, dtypes) -> None:
    c = sub.add_parser("megatron-deepspeed-to-mtds",
                       help="Megatron-DeepSpeed (GPTModelPipe) checkpoint -> mtds checkpoint at (tp, pp)")
    _import_args(c, dtypes, "Megatron-DeepSpeed --save folder (with DeepSpeed's 'latest') or a global_step* folder")


def run_megatron_deepspeed_to_mtds(args, dtype) -> str:
    from mtds.megatron.deepspeed_import import megatron_deepspeed_to_mtds
    return megatron_deepspeed_to_mtds(args.load, args.out, tp=args.tp, pp=args.pp, dtype=dtype)
