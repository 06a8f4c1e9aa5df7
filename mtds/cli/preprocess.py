"""`mtds-preprocess`: local text/json/jsonl/csv/parquet files or a save_to_disk folder -> Megatron
indexed datasets (PREFIX_{key}_document.bin/.idx), tokenized by N worker processes.

  mtds-preprocess --input mtds/assets/corpus --output-prefix data/shakespeare --append-eod --workers 2
  mtds-preprocess --input big.jsonl --output-prefix data/big --shard 0/2 ...   (and --shard 1/2, anywhere)
  mtds-preprocess --merge --output-prefix data/big                             (joins the shards)
  mtds-preprocess --hf-dataset DIR_OR_NAME --split train --output-prefix data/hf  (datasets' streaming mode)

Flag names follow Megatron's tools/preprocess_data.py. The tokenizer defaults to the shipped one,
as in train.py. Errors are one `error:` line on stderr, exit status 2; an interrupted run leaves
no .idx behind.
"""
from __future__ import annotations

import argparse
import resource
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"error: {message} (mtds-preprocess --help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="mtds-preprocess", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--input", metavar="PATH", help="file, directory of files, or save_to_disk folder")
    source.add_argument("--hf-dataset", metavar="NAME", help="an HF dataset read in streaming mode, record by record "
                        "(a local dataset folder, or a hub name where the hub is reachable)")
    ap.add_argument("--hf-config", metavar="NAME", help="the dataset's configuration (with --hf-dataset)")
    ap.add_argument("--split", default="train", help="the split to read (with --hf-dataset) [train]")
    ap.add_argument("--output-prefix", required=True, metavar="PREFIX",
                    help="writes PREFIX_{key}_document.bin/.idx for each json key")
    ap.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                    help="fields (json/csv/parquet columns) to tokenize, one dataset each [text]")
    ap.add_argument("--tokenizer", help="HF tokenizer directory or name [the shipped tokenizer]")
    ap.add_argument("--tokenizer-type",
                    help="Megatron's flag: GPT2BPETokenizer with --vocab-file and --merge-file (instead of --tokenizer)")
    ap.add_argument("--vocab-file", metavar="FILE", help="GPT-2 BPE vocab.json (with --tokenizer-type)")
    ap.add_argument("--merge-file", metavar="FILE", help="GPT-2 BPE merges.txt (with --tokenizer-type)")
    ap.add_argument("--workers", type=int, default=1, help="tokenizer processes [1]")
    ap.add_argument("--append-eod", action="store_true", help="end every document with the EOS token")
    ap.add_argument("--shard", metavar="i/N", help="process only shard i of N of the input (join with --merge)")
    ap.add_argument("--merge", action="store_true", help="join the shards written with --shard i/N")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing dataset at the prefix")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from mtds.data import DataError
    from mtds.data.indexed.preprocess import merge_shards, parse_shard, preprocess
    log = lambda line: print(line, flush=True)  # noqa: E731
    try:
        if args.merge:
            if args.input or args.hf_dataset or args.shard:
                raise DataError("--merge joins existing shards; drop --input/--hf-dataset/--shard")
            merge_shards(args.output_prefix, json_keys=args.json_keys, overwrite=args.overwrite, log=log)
        else:
            if not args.input and not args.hf_dataset:
                raise DataError("--input or --hf-dataset is required (or --merge to join shards)")
            from mtds.data.indexed.inputs import HFStream
            source = HFStream(args.hf_dataset, args.hf_config, args.split) if args.hf_dataset else args.input
            from mtds.data.megatron_tokenizer import tokenizer_from_flags
            tokenizer = tokenizer_from_flags(args.tokenizer, args.tokenizer_type, args.vocab_file, args.merge_file)
            preprocess(source, args.output_prefix, json_keys=args.json_keys, tokenizer=tokenizer,
                       workers=args.workers, append_eod=args.append_eod,
                       shard=parse_shard(args.shard) if args.shard else None, overwrite=args.overwrite,
                       show_progress=not args.no_progress, log=log)
    except (DataError, OSError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written (no .idx left behind)", file=sys.stderr, flush=True)
        sys.exit(130)
    log(f"peak RSS {_peak_rss_mib():.0f} MiB (main process)")


def _peak_rss_mib() -> float:
    """This process's own peak (VmHWM); ru_maxrss would include the launching process's RSS at fork."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    main()
