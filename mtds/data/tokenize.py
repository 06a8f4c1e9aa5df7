"""Tokenize raw documents with `datasets.map` into one flat token stream.

Every non-empty document becomes its token ids followed by EOS, and the
documents are concatenated in dataset order:

    doc0 <eos> doc1 <eos> doc2 <eos> ...

Empty or missing (None) documents are skipped, so EOS never repeats.
"""
import contextlib
import glob
import os

import numpy as np

from mtds.data.cache import token_dtype
from mtds.data.errors import DataError


@contextlib.contextmanager
def progress_bars(enabled: bool):
    """datasets' progress bars are global switches; restore the caller's setting."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    def switch(on: bool):
        if on:
            enable_progress_bars()
        else:
            disable_progress_bars()

    was_enabled = not are_progress_bars_disabled()
    switch(enabled)
    try:
        yield
    finally:
        switch(was_enabled)


def check_text_column(ds, text_column: str, description: str) -> None:
    if len(ds) == 0:
        raise DataError(f"dataset {description!r} is empty (0 rows)")
    if text_column not in ds.column_names:
        raise DataError(f"dataset {description!r} has no column {text_column!r}; available "
                        f"columns: {', '.join(ds.column_names)} (choose one with --text-column)")
    dtype = getattr(ds.features[text_column], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise DataError(f"column {text_column!r} of {description!r} holds {dtype or 'non-text'} "
                        f"values, not text; choose a text column with --text-column")


def tokenize_to_stream(ds, tok, text_column: str, *, num_proc: int, show_progress: bool,
                       work_dir: str, key: str) -> np.ndarray:
    """Return the flat stream as a numpy array (uint16 or int32)."""
    eos = tok.eos_token_id

    def encode(batch):
        texts = [t for t in batch[text_column] if t]
        # split_special_tokens: a literal "<|endoftext|>" in the text stays plain text,
        # so the only EOS ids in the stream are the document separators we add.
        ids = tok(texts, add_special_tokens=False, split_special_tokens=True,
                  return_attention_mask=False, verbose=False)["input_ids"] if texts else []
        return {"ids": [doc + [eos] for doc in ids]}

    if num_proc > 1:
        # Forked workers must not inherit the Rust thread pool (deadlock risk, noisy warning).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Per-process name: ranks that tokenize at the same time must not share a temp file.
    arrow = os.path.join(work_dir, f"tokenized-{key}-{os.getpid()}.arrow")
    try:
        with progress_bars(show_progress):
            out = ds.map(encode, batched=True, batch_size=256,
                         num_proc=num_proc if num_proc > 1 else None,
                         remove_columns=ds.column_names, desc="Tokenizing",
                         cache_file_name=arrow, new_fingerprint=key)
        tokens = _flatten(out, token_dtype(len(tok)))
    finally:
        # The indexed dataset written by the caller is the cache; the arrow copy would double disk use.
        for leftover in glob.glob(os.path.join(work_dir, f"tokenized-{key}-{os.getpid()}*.arrow")):
            os.remove(leftover)
    return tokens


def _flatten(out, dtype) -> np.ndarray:
    """Concatenate the per-document id lists straight from the Arrow buffers."""
    if "ids" not in out.column_names:  # every document was empty
        return np.zeros(0, dtype=dtype)
    column = out.data.column("ids")
    pieces = [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in column.chunks]
    pieces = [p for p in pieces if len(p)]
    if not pieces:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(pieces).astype(dtype, copy=False)
