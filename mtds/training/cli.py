"""Command line of train.py: flags -> TrainConfig -> run(), with one-line errors and a clean exit."""
from __future__ import annotations

import argparse
import os
import sys
import textwrap

from mtds.training.config import RECOMPUTE_MODES, TrainConfig

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
        self.exit(2, f"error: {message} (python train.py --help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="train.py", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Train a GPT with 3D parallelism (tensor x pipeline x data) on DeepSpeed.")
    g = p.add_argument_group("layout and model")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", required=True,
                   help="DeepSpeed JSON (batch sizes, precision, ZeRO stage, optimizer); see ds_configs/")
    g.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1,
                   help="tensor parallel size t (must divide attention heads) [1]")
    g.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=1,
                   help="pipeline stages p (ZeRO-2/3 need p = 1) [1]")
    g.add_argument("--pipeline-schedule", default="1f1b", metavar="NAME",
                   help="pipeline schedule: 1f1b (DeepSpeed's engine), interleaved (PTD-P interleaved 1F1B on "
                        "mtds's engine: bubble (p-1)/(v m); needs --virtual-stages >= 2 and micro-batches >= "
                        "--pp), zb-h1 (zero-bubble H1 on mtds's engine: weight gradients of the TP linears deferred to fill "
                        "the bubble; micro-batches >= --pp) or dualpipev (DeepSpeed's DualPipeVEngine; "
                        "micro-batches >= 2 pp) [1f1b]")
    g.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="model chunks per pipeline rank for --pipeline-schedule interleaved [1]")
    g.add_argument("--pipeline-layout", metavar="LAYOUT",
                   help="transformer blocks per virtual stage, Megatron-style: E embedding, t block, L final norm "
                        "+ LM head + loss, | next stage, X*n repeats, (...) groups; E first, L last, p x v stages "
                        "(dualpipev: 2p, in V order), e.g. 'Et*3|t*3|t*2L' or 'E|t*4|t*4|L' [--pipeline-balance]")
    g.add_argument("--pipeline-balance", choices=("uniform", "cost"),
                   help="without --pipeline-layout: uniform = the same number of blocks per stage; cost = split by "
                        "the planner's per-layer cost (embedding, blocks, final norm, LM head and loss, forward + "
                        "backward) with every rank's predicted memory within the device's [cost]")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallelism (Korthikanti et al. 2022): layer norms, dropout and residuals work "
                        "on 1/t of the sequence, saving activation memory; all-gathers and reduce-scatters replace "
                        "the all-reduces, plus one all-gather per column-parallel linear in backward (only the "
                        "input slice is kept); same losses. Needs t > 1 dividing --seq-length")
    g.add_argument("--model",
                   help="preset (gpt2-tiny, gpt2-small, gpt2-medium, gpt2-large, gpt2-xl) or a HF config.json "
                        "file/directory [the --init-from-hf directory, else gpt2-tiny]")
    g.add_argument("--init-from-hf", metavar="DIR", help="start from HuggingFace weights in DIR (each rank reads "
                                                         "only its layers and shards)")
    g.add_argument("--dropout", type=float, help="hidden and attention dropout (overrides the model config)")
    g.add_argument("--recompute", "--recompute-granularity", dest="recompute", choices=RECOMPUTE_MODES,
                   help="activation recomputation in backward: selective = the attention core (scores, softmax, "
                        "dropout; Korthikanti et al. 2022), full = whole blocks, --recompute-interval at a time "
                        "[none]")
    g.add_argument("--recompute-interval", "--recompute-num-layers", dest="recompute_interval", type=int,
                   metavar="N", help="with --recompute full: every N consecutive blocks are recomputed as one "
                                     "unit (only each unit's input is kept) [1]")
    g.add_argument("--recompute-method", choices=("uniform",),
                   help="Megatron's name for how --recompute full groups blocks; only uniform (what "
                        "--recompute-interval does) is supported")
    g.add_argument("--activation-checkpointing", nargs="?", const=1, type=int, metavar="K",
                   help="deprecated: --recompute full --recompute-interval K")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (CPU: Inductor's C++ backend, needs a C++ compiler; "
                        "the first steps pay the compilation) [off]")
    g.add_argument("--seed", type=int, default=1234, help="weights, data order and dropout all follow it [1234]")

    g = p.add_argument_group("data")
    g.add_argument("--data", help="text/json/jsonl/csv/parquet file or directory, a save_to_disk directory, or a "
                                  "datasets hub name [shipped Shakespeare corpus]")
    g.add_argument("--data-path", nargs="+", metavar="[W] PREFIX",
                   help="Megatron indexed data (PREFIX.bin/.idx from mtds-preprocess or Megatron): one PREFIX, or "
                        "weight prefix pairs to blend, e.g. 0.3 A 0.7 B (instead of --data)")
    g.add_argument("--eval-data-path", nargs="+", metavar="[W] PREFIX",
                   help="indexed evaluation data, same syntax (default: --eval-split of each source's documents)")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss where the input token is the tokenizer's EOS (end of document), as Megatron's")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="positions restart at 0 after each EOS: every packed document starts at position 0")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="each packed document attends only to its own tokens (block-diagonal causal mask)")
    g.add_argument("--text-column", default="text", help="field holding the text [text]")
    g.add_argument("--tokenizer", help="HF tokenizer name or path [shipped byte-level BPE]")
    g.add_argument("--tokenizer-type", help="Megatron's flag: GPT2BPETokenizer with --vocab-file and --merge-file "
                                            "(instead of --tokenizer)")
    g.add_argument("--vocab-file", metavar="FILE", help="GPT-2 BPE vocab.json (with --tokenizer-type)")
    g.add_argument("--merge-file", metavar="FILE", help="GPT-2 BPE merges.txt (with --tokenizer-type)")
    g.add_argument("--seq-length", type=int, default=128, help="tokens per sample [128]")
    g.add_argument("--num-proc", type=int, default=1, help="processes for tokenization [1]")
    g.add_argument("--eval-split", type=float, default=0.02, help="fraction held out for evaluation [0.02]")
    g.add_argument("--eval-data", help="separate evaluation data (instead of --eval-split)")
    g.add_argument("--eval-interval", type=int, default=0, help="evaluate every N steps (0: at the end) [0]")
    g.add_argument("--eval-iters", type=int, default=4, help="global batches per evaluation [4]")

    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=100, help="optimizer steps [100]")
    g.add_argument("--global-batch-size", type=int, metavar="B",
                   help="sequences per optimizer step over all data-parallel ranks (overrides the DeepSpeed "
                        "config's train_batch_size; accumulation = B / (micro batch x dp))")
    g.add_argument("--micro-batch-size", type=int, metavar="b",
                   help="sequences per micro-batch per rank (overrides train_micro_batch_size_per_gpu)")
    g.add_argument("--lr", type=float, help="peak learning rate (overrides the DeepSpeed config)")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of decay [0]")
    g.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps [0]")
    g.add_argument("--lr-decay", choices=("cosine", "linear", "constant"), default="cosine",
                   help="decay after warm-up (unless the DeepSpeed config has a scheduler) [cosine]")
    g.add_argument("--zero1-grad-reduce", choices=("reduce-scatter", "all-reduce"), default="reduce-scatter",
                   help="ZeRO-1's data-parallel gradient reduction: reduce-scatter, each rank summing only the "
                        "partition it updates (2(d-1)/d x the parameters' bytes per step with the all-gather), or "
                        "DeepSpeed's own all-reduce (3(d-1)/d) [reduce-scatter]")

    g = p.add_argument_group("checkpoints and logs")
    g.add_argument("--save", metavar="DIR", help="checkpoint directory")
    g.add_argument("--save-interval", type=int, default=0, help="save every N steps (and at the end) [0]")
    g.add_argument("--keep-last", type=int, default=0, metavar="K",
                   help="after each complete save delete all but the newest K complete checkpoints [0: keep all]")
    g.add_argument("--load", metavar="DIR", help="resume from the newest complete checkpoint in DIR (or the "
                                                 "global_stepN folder given), naming any incomplete one skipped")
    g.add_argument("--log-jsonl", metavar="FILE", help="one JSON object per step (and per evaluation)")
    g.add_argument("--tensorboard", metavar="DIR", help="TensorBoard scalars")
    g.add_argument("--plot", metavar="PNG", help="write loss / learning-rate / throughput curves here at the end")
    g.add_argument("--timeline", metavar="JSON",
                   help="pipeline timeline: measured bubble per stage in every step's log; the last step as a "
                        "Chrome trace (open in Perfetto) here and a Gantt chart PNG next to it")
    g.add_argument("--profile-step", type=int, metavar="N",
                   help="profile step N with torch.profiler (CPU, and CUDA on GPUs): one console line of where its "
                        "time went by kind of work (GEMM, attention, element-wise, copies, reductions, norms, "
                        "optimizer, collectives), kernel count and how busy the device was")
    g.add_argument("--profile-trace", metavar="JSON",
                   help="with --profile-step: that step's Chrome trace, one file per rank (FILE.rankR.json)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    g.add_argument("--check-replicas", type=int, default=0, metavar="N",
                   help="every N steps verify TP-replicated and tied weights are identical [off]")
    g.add_argument("--dist-timeout", type=float, default=600.0, help="seconds before a collective gives up [600]")
    g.add_argument("--on-nan", choices=("stop", "skip"), default="stop",
                   help="a NaN/inf loss or grad norm (bf16/fp32): stop with one line naming the step and the ranks "
                        "whose own gradients were non-finite, saving nothing, or skip steps the optimizer did not "
                        "apply (ZeRO-1/2) [stop]")
    g.add_argument("--no-save-on-signal", dest="save_on_signal", action="store_false",
                   help="on SIGTERM/SIGINT stop after the current step without saving (default: save with --save)")
    g.add_argument("--heartbeat-timeout", type=float, default=30.0, metavar="S",
                   help="stop (exit 1, naming the rank) when a peer rank is silent this long: dead or frozen where no "
                        "socket says so; 0 turns the watchdog off [30]")
    g.add_argument("--build-lock-timeout", type=float, default=300.0, metavar="S",
                   help="fail start-up when a torch-extensions build lock is waited on for S seconds [300]")
    p.add_argument("--debug", action="store_true", help="print the traceback of a bad-input error too")
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
    recompute, interval = recompute_from_args(args)
    overrides = {}
    if args.dropout is not None:
        overrides.update(hidden_dropout=args.dropout, attention_dropout=args.dropout)
    from mtds.data.megatron_tokenizer import tokenizer_from_flags
    tokenizer = tokenizer_from_flags(args.tokenizer, args.tokenizer_type, args.vocab_file, args.merge_file)
    return TrainConfig(
        deepspeed_config=args.deepspeed_config, model=args.model or args.init_from_hf or "gpt2-tiny",
        model_overrides=overrides, tp=args.tp, pp=args.pp, sequence_parallel=args.sequence_parallel,
        pipeline_schedule=args.pipeline_schedule, virtual_stages=args.virtual_stages,
        zero1_grad_reduce=args.zero1_grad_reduce,
        pipeline_layout=args.pipeline_layout, pipeline_balance=args.pipeline_balance,
        data=args.data, text_column=args.text_column, tokenizer=tokenizer, seq_length=args.seq_length,
        num_proc=args.num_proc, eval_split=args.eval_split, eval_data=args.eval_data,
        data_path=tuple(args.data_path) if args.data_path else None,
        eval_data_path=tuple(args.eval_data_path) if args.eval_data_path else None, eod_mask_loss=args.eod_mask_loss,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters, steps=args.steps, lr=args.lr,
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
        min_lr=args.min_lr, warmup_steps=args.warmup_steps, lr_decay=args.lr_decay, seed=args.seed,
        recompute=recompute, recompute_interval=interval, compile=args.compile,
        init_from_hf=args.init_from_hf, save=args.save, save_interval=args.save_interval, keep_last=args.keep_last,
        load=args.load, log_jsonl=args.log_jsonl, tensorboard=args.tensorboard,
        plot=args.plot, timeline=args.timeline, profile_step=args.profile_step, profile_trace=args.profile_trace,
        progress=False if args.no_progress else None, check_replicas_interval=args.check_replicas,
        dist_timeout_s=args.dist_timeout, on_nan=args.on_nan, save_on_signal=args.save_on_signal,
        build_lock_timeout_s=args.build_lock_timeout, heartbeat_timeout_s=args.heartbeat_timeout)


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
    from mtds.training.distributed import run_and_exit

    def work():
        from mtds.training.job import run
        run(config_from_args(args))

    run_and_exit(work, user_errors(), debug=args.debug)
