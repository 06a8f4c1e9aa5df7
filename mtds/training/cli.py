"""Command line of train.py: flags -> TrainConfig -> run(), with one-line errors and a clean exit.

The flags are TrainConfig's fields (mtds.training.options); here are only the few that are not.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap

from mtds.training.config import TrainConfig
from mtds.training.options import add_flags, given_values

EPILOG = textwrap.dedent("""\
    examples:
      deepspeed --num_gpus 2 train.py --deepspeed_config ds_configs/cpu_fp32.json --tp 2 --steps 50
      torchrun --nproc_per_node 8 train.py --deepspeed_config ds_configs/cpu_fp32.json --tp 2 --pp 2
      deepspeed --num_gpus 8 train.py --deepspeed_config ds_configs/ptdp_bf16.json --model gpt2-medium --tp 4 --pp 2 \
          --global-batch-size 64

    The data-parallel size is derived: d = world size / (tp * pp). Global and micro batch come from the
    DeepSpeed config or --global-batch-size / --micro-batch-size; gradient accumulation (= pipeline
    micro-batches) is derived from them and d.
    """)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one ``error:`` line (exit 2) like every other bad input."""

    def error(self, message):
        from mtds.training.distributed import report_error
        from mtds.training.megatron_flags import hint
        report_error(f"{hint(message) or message} (python train.py --help lists the options)")  # first rank only
        self.exit(2)


def _cli_only(group: argparse._ArgumentGroup, after: str) -> None:
    """The flags that are no TrainConfig field, each in its place in --help (after field ``after``'s flag)."""
    if after == "init_from_hf":     # one value for two ModelConfig keys: config_from_args fills model_overrides
        group.add_argument("--dropout", type=float, help="hidden and attention dropout (overrides the model config)")
        # Megatron's two: each overrides its half of --dropout (attention dropout cannot run at --cp > 1)
        group.add_argument("--hidden-dropout", type=float, metavar="P",
                           help="dropout of the embedding and the residual branches (overrides --dropout)")
        group.add_argument("--attention-dropout", type=float, metavar="P",
                           help="dropout of the attention probabilities (overrides --dropout)")
    elif after == "recompute_interval":
        # Megatron's; its one value is what --recompute-interval does, so there is nothing to keep
        group.add_argument("--recompute-method", choices=("uniform",),
                           help="Megatron's name for how --recompute full groups blocks; only uniform (what "
                                "--recompute-interval does) is supported")
        # the old spelling of two fields: recompute_from_args maps it onto them
        group.add_argument("--activation-checkpointing", nargs="?", const=1, type=int, metavar="K",
                           help="deprecated: --recompute full --recompute-interval K")
    elif after == "tokenizer":      # Megatron's three flags make one tokenizer directory (tokenizer_from_flags)
        group.add_argument("--tokenizer-type", help="Megatron's flag: GPT2BPETokenizer with --vocab-file and "
                                                    "--merge-file (instead of --tokenizer)")
        group.add_argument("--vocab-file", metavar="FILE", help="GPT-2 BPE vocab.json (with --tokenizer-type)")
        group.add_argument("--merge-file", metavar="FILE", help="GPT-2 BPE merges.txt (with --tokenizer-type)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="train.py", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Train a GPT with 3D parallelism (tensor x pipeline x data) on DeepSpeed.")
    add_flags(p, TrainConfig, after=_cli_only)      # every TrainConfig field's flags (mtds.training.options)
    # how train.py reports an error, not a setting of the run
    p.add_argument("--debug", action="store_true",
                   help="print the traceback of a bad-input error too, and the third-party warnings and progress "
                        "bars mtds hides (mtds/observe/quiet.py lists them)")
    # Set by the deepspeed launcher; the rank comes from the environment anyway.
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    return p


def recompute_from_args(args: argparse.Namespace) -> tuple[str, int]:
    """(--recompute, --recompute-interval), with the deprecated --activation-checkpointing K mapped onto
    them (one warning line, on the first rank only)."""
    mode, interval, k = args.recompute, args.recompute_interval, args.activation_checkpointing
    if k is not None:
        if os.environ.get("RANK", "0") == "0":
            print(f"warning: --activation-checkpointing is deprecated: use --recompute full --recompute-interval {k}",
                  file=sys.stderr, flush=True)
        if k < 0:
            raise ValueError(f"--activation-checkpointing takes a block interval >= 0, got {k}: use "
                             f"--recompute full --recompute-interval N")
        if k and mode not in (None, "full"):
            raise ValueError(f"--activation-checkpointing {k} means --recompute full (every {k} blocks) and "
                             f"conflicts with --recompute {mode}: drop one of the two")
        if k and interval not in (None, k):
            raise ValueError(f"--activation-checkpointing {k} conflicts with --recompute-interval {interval}: "
                             f"drop --activation-checkpointing")
        if k:
            mode, interval = "full", k
    return mode or "none", 1 if interval is None else interval


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = given_values(args, TrainConfig)        # the flags given; TrainConfig's defaults for the rest
    values["recompute"], values["recompute_interval"] = recompute_from_args(args)
    overrides = {} if args.dropout is None else dict(hidden_dropout=args.dropout, attention_dropout=args.dropout)
    for key in ("hidden_dropout", "attention_dropout"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if overrides:
        values["model_overrides"] = overrides
    from mtds.data.megatron_tokenizer import tokenizer_from_flags
    values["tokenizer"] = tokenizer_from_flags(args.tokenizer, args.tokenizer_type, args.vocab_file, args.merge_file)
    return TrainConfig(**values)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "bad input": reported as one line, not a traceback."""
    from mtds.data import DataError
    from mtds.parallel.layout import LayoutError
    from mtds.safety.numerics import NonFiniteError
    from mtds.safety.startup import RendezvousError

    from mtds.checkpoint.lifecycle import CheckpointError
    from mtds.training.consistency import ReplicaMismatch
    from mtds.training.ds_config import ConfigError
    return (LayoutError, ConfigError, DataError, CheckpointError, ReplicaMismatch, NonFiniteError, RendezvousError,
            ValueError, FileNotFoundError)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from mtds.observe import quiet
    quiet.install(debug=args.debug)     # before anything imports DeepSpeed
    from mtds.training.distributed import CommandLineError, run_and_exit

    def work():
        try:
            cfg = config_from_args(args)
        except (ValueError, FileNotFoundError) as err:     # the same on every rank: only the first says it
            raise CommandLineError(str(err)) from err
        from mtds.training.job import run   # imports DeepSpeed: after the command line is known to be good
        run(cfg)

    run_and_exit(work, user_errors, debug=args.debug)
