#!/usr/bin/env python
"""Train the small byte-level BPE tokenizer shipped in mtds/assets/tokenizer/.

It is trained with `tokenizers` on the shipped corpus (mtds/assets/corpus/*.txt)
and saved as a transformers fast tokenizer, so that
`AutoTokenizer.from_pretrained("mtds/assets/tokenizer")` reloads it offline.

Byte-level BPE never produces an unknown token, so bos/eos/unk can all be the
single special token <|endoftext|> (the GPT-2 convention); the data pipeline
uses it to separate documents.

Usage:
    python scripts/train_tokenizer.py [--vocab-size 8192] [--out DIR] [FILES...]
"""
import argparse
import glob
import os

from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

ASSETS = os.path.join(os.path.dirname(__file__), "..", "mtds", "assets")
EOS = "<|endoftext|>"


def train(files, vocab_size: int, out_dir: str) -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer()  # GPT-2 style: bytes -> unicode, no prefix space
    bpe.train(files=sorted(files), vocab_size=vocab_size, min_frequency=2,
              special_tokens=[EOS], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer,
                                  bos_token=EOS, eos_token=EOS, unk_token=EOS)
    os.makedirs(out_dir, exist_ok=True)
    tok.save_pretrained(out_dir)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", help="training text files (default: shipped corpus)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--out", default=os.path.join(ASSETS, "tokenizer"))
    args = parser.parse_args()

    files = args.files or glob.glob(os.path.join(ASSETS, "corpus", "*.txt"))
    if not files:
        raise SystemExit("error: no training files; run scripts/build_corpus.py first")
    tok = train(files, args.vocab_size, args.out)
    print(f"saved tokenizer with {len(tok)} tokens (eos id {tok.eos_token_id}) "
          f"to {os.path.abspath(args.out)}")


if __name__ == "__main__":
    main()
