"""Megatron's tokenizer flags (``--tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M``),
for scripts written for Megatron's tools and its GPT-2 files.

They name a byte-level BPE by its two files; mtds reads tokenizers as HF directories, so the flags
become one: transformers' ``GPT2TokenizerFast`` loads the two files (local, never the hub) and is
saved once, under a name made of the files' content, as a directory that ``--tokenizer`` then takes
(the same for train.py, mtds-preprocess and its workers).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from mtds.data.errors import DataError

TOKENIZER_TYPES = ("GPT2BPETokenizer",)


def tokenizer_from_flags(tokenizer, tokenizer_type=None, vocab_file=None, merge_file=None):
    """The ``--tokenizer`` to use: ``tokenizer`` as given, or the directory Megatron's flags make."""
    if tokenizer_type is None:
        if vocab_file or merge_file:
            raise DataError("--vocab-file/--merge-file need --tokenizer-type GPT2BPETokenizer")
        return tokenizer
    if tokenizer is not None:
        raise DataError("--tokenizer and --tokenizer-type both name a tokenizer; keep one")
    if tokenizer_type not in TOKENIZER_TYPES:
        raise DataError(f"--tokenizer-type {tokenizer_type} is not supported: only GPT2BPETokenizer (with "
                        f"--vocab-file and --merge-file); for another, pass an HF tokenizer directory as --tokenizer")
    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not path:
            raise DataError(f"--tokenizer-type GPT2BPETokenizer needs {flag}")
        if not os.path.isfile(path):
            raise DataError(f"{flag} {path} does not exist")
    return _saved_gpt2_bpe(vocab_file, merge_file)


def _cache_root() -> str:
    root = os.environ.get("MTDS_DATA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mtds")
    return os.path.join(root, "tokenizers")


def _saved_gpt2_bpe(vocab_file: str, merge_file: str) -> str:
    h = hashlib.sha256()
    for path in (vocab_file, merge_file):
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    final = os.path.join(_cache_root(), f"gpt2bpe-{h.hexdigest()[:20]}")
    if os.path.isfile(os.path.join(final, "tokenizer.json")):
        return final
    os.makedirs(_cache_root(), exist_ok=True)
    work = tempfile.mkdtemp(dir=_cache_root(), prefix=".tmp-gpt2bpe-")
    try:
        # the file names GPT2TokenizerFast looks for in a directory
        shutil.copyfile(vocab_file, os.path.join(work, "vocab.json"))
        shutil.copyfile(merge_file, os.path.join(work, "merges.txt"))
        from transformers import GPT2TokenizerFast
        try:
            tok = GPT2TokenizerFast.from_pretrained(work, local_files_only=True)
        except Exception as exc:   # malformed json, a merges line that is not a pair, ...
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(f"could not read --vocab-file {vocab_file} / --merge-file {merge_file} as GPT-2 BPE "
                            f"files: {first}") from exc
        tok.save_pretrained(work)
        try:
            os.rename(work, final)     # atomic; another process may have saved the same files first
        except OSError:
            if not os.path.isfile(os.path.join(final, "tokenizer.json")):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final
