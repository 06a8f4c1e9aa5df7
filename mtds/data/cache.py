"""Where tokenized data is cached, and how it is stored.

The cache holds the *flat token stream* of a corpus (documents + EOS), one
`.npy` per (data, tokenizer, text column) key. Packing into blocks is done on
the fly from it, so changing seq_length or the split reuses the cache.

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


def _paths(cache_dir: str, key: str):
    stem = os.path.join(cache_dir, f"tokens-{key}")
    return stem + ".npy", stem + ".json"


def load_tokens(cache_dir: str, key: str):
    """The cached token stream (memory-mapped) and its metadata, or (None, None)."""
    npy, meta = _paths(cache_dir, key)
    if not (os.path.exists(npy) and os.path.exists(meta)):
        return None, None
    with open(meta) as f:
        info = json.load(f)
    return np.load(npy, mmap_mode="r"), info


def save_tokens(cache_dir: str, key: str, tokens: np.ndarray, info: dict) -> None:
    """Write atomically (tmp + rename) so concurrent ranks never read a partial file."""
    npy, meta = _paths(cache_dir, key)
    for path, write in ((npy, lambda f: np.save(f, tokens)),
                        (meta, lambda f: f.write(json.dumps(info, indent=1).encode()))):
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)


def token_dtype(vocab_size: int):
    """uint16 halves the cache for vocabularies up to 65536 tokens."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
