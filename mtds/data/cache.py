"""Where tokenized data is cached, and how it is stored.

The cache holds the *flat token stream* of a corpus (documents + EOS) per (data,
tokenizer, text column) key, written by the indexed writer as a Megatron dataset
`tokens-KEY.bin/.idx` (one sequence per document, its EOS included) plus
`tokens-KEY.json`, and read back by the indexed reader: one format and one reader
for both data paths. Packing into blocks is done on the fly from the stream, so
changing seq_length or the split reuses the cache.

Location, first match wins:
  1. the `cache_dir` argument (tests use a tmp dir);
  2. the MTDS_DATA_CACHE environment variable;
  3. `.mtds_cache/` next to the data (inside a data directory, beside a data file),
     when that place is writable — "cached next to the data";
  4. $XDG_CACHE_HOME/mtds/data (default ~/.cache/mtds/data), e.g. for hub datasets
     or read-only data.
"""
import hashlib
import json
import os
import tempfile

import numpy as np


def choose_cache_dir(explicit=None, home=None) -> str:
    for candidate in (explicit, os.environ.get("MTDS_DATA_CACHE") or None, home):
        if candidate and _writable_dir(candidate):
            return os.path.abspath(candidate)
    fallback = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                            "mtds", "data")
    os.makedirs(fallback, exist_ok=True)
    return fallback


def _writable_dir(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def cache_key(parts: dict) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def _prefix(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, f"tokens-{key}")


def load_tokens(cache_dir: str, key: str):
    """The cached token stream (the memory-mapped .bin) and its metadata, or (None, None)."""
    from mtds.data.indexed import IndexedDataset
    prefix = _prefix(cache_dir, key)
    if not all(os.path.exists(prefix + ext) for ext in (".json", ".idx", ".bin")):
        return None, None
    with open(prefix + ".json") as f:
        info = json.load(f)
    ds = IndexedDataset(prefix)
    return ds.ids[:ds.num_tokens], info


def save_tokens(cache_dir: str, key: str, tokens: np.ndarray, info: dict) -> None:
    """Through the indexed writer (temporaries renamed into place), then the .json last, so a
    concurrent rank never reads a partial cache: ``load_tokens`` needs all three files."""
    from mtds.data.indexed import IndexedWriter
    prefix = _prefix(cache_dir, key)
    ends = np.flatnonzero(np.asarray(tokens) == info["eos_token_id"]) + 1   # every document ends with EOS
    if len(tokens) and (not len(ends) or ends[-1] != len(tokens)):
        ends = np.append(ends, len(tokens))
    with IndexedWriter(prefix, tokens.dtype) as w:
        w.add_documents(tokens, np.diff(ends, prepend=0))
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps(info, indent=1).encode())
    os.replace(tmp, prefix + ".json")


def token_dtype(vocab_size: int):
    """uint16 halves the cache for vocabularies up to 65536 tokens."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
