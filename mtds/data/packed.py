"""Packed LM samples: fixed windows of `seq_length + 1` tokens over the token stream.

Sample i is tokens[i*s : i*s + s + 1] with s = seq_length (Megatron's layout):
inputs are its first s tokens and labels its last s, so consecutive samples
share one boundary token and every token of the stream (but the first) is a
label exactly once. Documents run across sample boundaries; the EOS tokens in
the stream mark where they end. The tail shorter than s + 1 tokens is dropped.
"""
import os

import numpy as np
import torch

from mtds.data.cache import cache_key, choose_cache_dir, load_tokens, save_tokens
from mtds.data.errors import DataError
from mtds.data.source import resolve_source
from mtds.data.tokenize import check_text_column, progress_bars, tokenize_to_stream
from mtds.data.tokenizer import tokenizer_fingerprint

# Bump when the stream format changes so old caches are not reused.
_FORMAT_VERSION = 2   # 2: an indexed dataset keyed by content


class PackedDataset:
    """Map-style dataset: `ds[i]` is a LongTensor of seq_length + 1 token ids.

    `indices` (optional) selects and orders a subset of the windows; it is how
    train/eval splits share one token stream without copying it.
    """

    def __init__(self, tokens: np.ndarray, seq_length: int, indices=None, *, info=None):
        if seq_length < 1:
            raise DataError(f"seq_length must be a positive integer, got {seq_length}")
        self.tokens = tokens
        self.seq_length = seq_length
        self.num_windows = max(0, (len(tokens) - 1) // seq_length)
        self.indices = None if indices is None else np.asarray(indices, dtype=np.int64)
        self.info = dict(info or {})  # provenance: source, tokenizer, token/document counts

    def __len__(self) -> int:
        return self.num_windows if self.indices is None else len(self.indices)

    def window(self, j: int) -> np.ndarray:
        """Raw window j of the stream (ignores `indices`)."""
        start = j * self.seq_length
        return self.tokens[start:start + self.seq_length + 1]

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        j = i % len(self) if self.indices is None else int(self.indices[i])
        return torch.from_numpy(self.window(j).astype(np.int64))

    def subset(self, indices) -> "PackedDataset":
        """A view on some of this dataset's samples (indices into this dataset)."""
        indices = np.asarray(indices, dtype=np.int64)
        base = indices if self.indices is None else self.indices[indices]
        return PackedDataset(self.tokens, self.seq_length, base, info=self.info)


def build_packed_dataset(data_spec, tok, seq_length: int, *, text_column: str = "text",
                         num_proc: int = 1, cache_dir=None, show_progress: bool = True,
                         split=None) -> PackedDataset:
    """Load, tokenize (cached) and pack `data_spec` (None = shipped corpus).

    See mtds/data/source.py for the accepted specs and mtds/data/cache.py for
    where the cache goes. Raises DataError on bad input.
    """
    if not isinstance(seq_length, int) or seq_length < 1:
        raise DataError(f"seq_length must be a positive integer, got {seq_length!r}")
    source = resolve_source(data_spec, split)
    work_dir = choose_cache_dir(cache_dir, source.home)
    key_parts = {"v": _FORMAT_VERSION, "source": source.identity, "column": text_column,
                 "tokenizer": tokenizer_fingerprint(tok)}

    tokens = info = None
    if source.identity is not None:  # local data: a hit skips `datasets` entirely
        tokens, info = load_tokens(work_dir, cache_key(key_parts))
    if tokens is None:
        from mtds.observe.quiet import local_load_bars
        # datasets' bars for reading local files say nothing (mtds.observe.quiet); a hub download's stay
        with progress_bars(show_progress and (source.identity is None or local_load_bars())):
            ds = source.load(_hf_dir(work_dir))
        if source.identity is None:  # hub data: key on the loaded dataset's fingerprint
            key_parts["source"] = {"hub": source.description, "fingerprint": ds._fingerprint}
            tokens, info = load_tokens(work_dir, cache_key(key_parts))
        if tokens is None:
            tokens, info = _tokenize(ds, tok, text_column, source.description, num_proc,
                                     show_progress, work_dir, cache_key(key_parts))
    info["from_cache"] = info.get("from_cache", True)

    ds = PackedDataset(tokens, seq_length, info=info)
    if len(ds) == 0:
        raise DataError(f"dataset {source.description!r} has only {len(tokens)} tokens, fewer "
                        f"than seq_length + 1 = {seq_length + 1}; use more data or a shorter "
                        f"--seq-length")
    return ds


def _hf_dir(work_dir: str) -> str:
    """datasets' own Arrow cache (for the raw data) lives inside ours."""
    return os.path.join(work_dir, "hf")


def _tokenize(ds, tok, text_column, description, num_proc, show_progress, work_dir, key):
    check_text_column(ds, text_column, description)
    tokens = tokenize_to_stream(ds, tok, text_column, num_proc=num_proc,
                                show_progress=show_progress, work_dir=work_dir, key=key)
    num_docs = int(np.count_nonzero(tokens == tok.eos_token_id))
    if num_docs == 0:
        raise DataError(f"dataset {description!r} is empty: column {text_column!r} holds no text")
    info = {"source": description, "text_column": text_column, "num_tokens": int(len(tokens)),
            "num_documents": num_docs, "eos_token_id": int(tok.eos_token_id),
            "tokenizer": getattr(tok, "name_or_path", "")}
    save_tokens(work_dir, key, tokens, info)
    return tokens, dict(info, from_cache=False)
