"""`mtds-convert`: HuggingFace <-> mtds checkpoints, and resharding preparation.

  mtds-convert hf-to-mtds --hf DIR --tp T --pp P --out DIR     HF weights -> checkpoint for train.py --load
  mtds-convert mtds-to-hf --ckpt DIR --out DIR                 any mtds checkpoint -> from_pretrained dir
  mtds-convert to-universal --ckpt DIR                         DeepSpeed universal checkpoint (resharding)
  mtds-convert megatron-to-mtds --load DIR --tp T --pp P --out DIR   Megatron-LM torch_dist -> mtds
  mtds-convert mtds-to-megatron --ckpt DIR --out DIR           any mtds checkpoint -> Megatron-LM torch_dist
  mtds-convert megatron-deepspeed-to-mtds --load DIR --tp T --pp P --out DIR   Megatron-DeepSpeed -> mtds

Both weight directions stream: one layer (hf-to-mtds at p > 1, mtds-to-hf) or one TP rank's shard
(hf-to-mtds at p = 1) is in memory at a time. Errors are one line on stderr, exit status 2.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mtds-convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    a = sub.add_parser("hf-to-mtds", help="HF directory -> mtds checkpoint sharded for (tp, pp)")
    a.add_argument("--hf", required=True, metavar="DIR", help="HF model dir (config.json + safetensors or .bin)")
    a.add_argument("--tp", type=int, default=1, help="tensor parallel size of the target layout [1]")
    a.add_argument("--pp", type=int, default=1, help="pipeline stages of the target layout [1]")
    a.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to create (for --load)")
    a.add_argument("--dtype", choices=sorted(_DTYPES), help="cast weights (default: keep the HF dtype)")

    b = sub.add_parser("mtds-to-hf", help="mtds checkpoint (any layout, ZeRO-0/1/2/3) -> HF directory")
    b.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint root (with 'latest') or a tag folder")
    b.add_argument("--out", required=True, metavar="DIR", help="HF directory to write")
    b.add_argument("--max-shard-size", default="2GB", help="safetensors shard size, e.g. 500MB, 2GB [2GB]")
    b.add_argument("--dtype", choices=sorted(_DTYPES), help="cast weights (default: as saved)")
    b.add_argument("--tokenizer", help="tokenizer dir to copy (default: the one recorded in the checkpoint)")

    c = sub.add_parser("to-universal", help="convert the latest checkpoint to DeepSpeed's universal format "
                                            "(train.py --load does this itself when the layout changes)")
    c.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint root (with 'latest')")

    from mtds.cli.convert_megatron import add_commands, add_deepspeed_command
    add_commands(sub, _DTYPES)
    add_deepspeed_command(sub, _DTYPES)
    return ap


def _bytes(text: str) -> int:
    units = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "B": 1}
    t = text.strip().upper()
    for unit, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * scale)
    return int(t)


def _dtype(name: str | None):
    import torch
    return None if name is None else getattr(torch, _DTYPES[name])


def _tokenizer_dir(path: str) -> str | None:
    from mtds.hf.stream_export import TOKENIZER_FILES
    return os.path.abspath(path) if any(os.path.isfile(os.path.join(path, n)) for n in TOKENIZER_FILES) else None


def run_hf_to_mtds(args) -> str:
    from mtds.hf.init import hf_model_config
    from mtds.hf.load import open_hf_checkpoint
    from mtds.hf.registry import hf_state_to_layers
    from mtds import rules
    from mtds.hf.stream_source import StreamingHFCheckpoint
    from mtds.checkpoint.writer import write_weights_checkpoint

    if not os.path.isdir(args.hf):
        raise FileNotFoundError(f"HF directory {args.hf!r} does not exist")
    cfg = hf_model_config(args.hf)
    rules.check_shards(cfg.facts(), tp=args.tp, pp=args.pp)
    source = StreamingHFCheckpoint(args.hf)             # reads only index/headers now
    get_tensor = open_hf_checkpoint(cfg, source)        # refuses tensors our model has no place for
    if os.path.isdir(args.out) and os.listdir(args.out):
        raise FileExistsError(f"output directory {args.out!r} is not empty")
    return write_weights_checkpoint(args.out, cfg, lambda: hf_state_to_layers(cfg, get_tensor), tp=args.tp,
                                    pp=args.pp, dtype=_dtype(args.dtype), tokenizer=_tokenizer_dir(args.hf))


def run_mtds_to_hf(args) -> list[str]:
    from mtds.hf.stream_export import write_hf_dir
    from mtds.checkpoint.reader import open_checkpoint
    ckpt = open_checkpoint(args.ckpt)
    tokenizer = args.tokenizer or ckpt.meta.tokenizer
    return write_hf_dir(args.out, ckpt.cfg, ckpt.layers(), max_shard_bytes=_bytes(args.max_shard_size),
                        tokenizer=tokenizer, dtype=_dtype(args.dtype))


def run_to_universal(args) -> str:
    from mtds.checkpoint.universal import ensure_universal
    return ensure_universal(args.ckpt)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from mtds.observe import quiet
    quiet.install()     # before anything imports DeepSpeed
    start = time.perf_counter()
    try:
        if args.command == "hf-to-mtds":
            where = run_hf_to_mtds(args)
        elif args.command == "mtds-to-hf":
            run_mtds_to_hf(args)
            where = args.out
        elif args.command == "megatron-to-mtds":
            from mtds.cli.convert_megatron import run_megatron_to_mtds
            where = run_megatron_to_mtds(args, _dtype(args.dtype))
        elif args.command == "megatron-deepspeed-to-mtds":
            from mtds.cli.convert_megatron import run_megatron_deepspeed_to_mtds
            where = run_megatron_deepspeed_to_mtds(args, _dtype(args.dtype))
        elif args.command == "mtds-to-megatron":
            from mtds.cli.convert_megatron import run_mtds_to_megatron
            where = run_mtds_to_megatron(args, _dtype(args.dtype))
        else:
            where = run_to_universal(args)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError, OSError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.command}: wrote {where} in {time.perf_counter() - start:.1f} s (peak RSS {rss_mib:.0f} MiB)",
          flush=True)


if __name__ == "__main__":
    main()
