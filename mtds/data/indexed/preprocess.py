"""Tokenize documents into Megatron indexed datasets with N worker processes, streaming.

The main process reads documents and cuts them into chunks; workers tokenize chunks; the main
process writes their ids in input order. At most 2 chunks per worker are in flight, so memory is
bounded by the chunk size and the worker count, never by the corpus. Output, per json key, is
`PREFIX_{key}_document.{bin,idx}` (Megatron's preprocess_data.py naming, so its training scripts
carry over); `--shard i/N` takes every N-th document from the i-th on into `PREFIX_{key}_document.shard-i-of-N`,
and `merge_shards` joins the shards in shard order.
"""
import collections
import glob
import os
import re
import time

import numpy as np

from mtds.data.errors import DataError
from mtds.data.indexed.format import bin_path, dtype_for_vocab, idx_path
from mtds.data.indexed.inputs import iter_documents
from mtds.data.indexed.reader import IndexedDataset
from mtds.data.indexed.writer import IndexedWriter, merge_indexed

CHUNK_DOCS = 256                # documents per chunk ...
CHUNK_CHARS = 4 * 1024 * 1024   # ... or fewer, once they hold this much text


def output_prefix(prefix: str, key: str, shard=None) -> str:
    base = f"{prefix}_{key}_document"
    return base if shard is None or shard[1] == 1 else f"{base}.shard-{shard[0]}-of-{shard[1]}"


def parse_shard(text: str):
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise DataError(f"--shard takes i/N with 0 <= i < N (e.g. 0/4), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def check_free(prefix: str, overwrite: bool) -> None:
    """Refuse to replace a dataset unless asked; clear temporaries a killed run left behind."""
    for path in (idx_path(prefix), bin_path(prefix)):
        if os.path.exists(path) and not overwrite:
            raise DataError(f"{path} already exists; pass --overwrite to replace it or choose "
                            f"another --output-prefix")
    for tmp in glob.glob(glob.escape(prefix) + ".*.tmp-*"):
        pid = tmp.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            os.remove(tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- workers ----------------------------------------------------------------------------------
_ENCODER = None   # per worker process: set once by the pool initializer, read by _encode


class _Encoder:
    """Token ids of documents, as `tok(texts, add_special_tokens=False, split_special_tokens=True)`.

    A fast tokenizer travels as its Rust backend's JSON: workers then need only `tokenizers`
    (no transformers, no torch: ~0.1 s and tens of MB each instead of seconds and ~300 MB).
    """

    def __init__(self, spec, keys, append_eod):
        kind, payload, self.eos = spec
        if kind == "backend":
            from tokenizers import Tokenizer
            self.backend = Tokenizer.from_str(payload)
            # split_special_tokens: a literal "<|endoftext|>" in a text stays text, so EOD
            # ids appear only where --append-eod puts them.
            self.backend.encode_special_tokens = True
            self.tok = None
        else:   # a slow (python) tokenizer: load it by name
            from mtds.data.tokenizer import load_tokenizer
            self.tok = load_tokenizer(payload)
        self.keys, self.append_eod = keys, append_eod

    def _ids(self, texts):
        if self.tok is None:
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        return self.tok(texts, add_special_tokens=False, split_special_tokens=True,
                        return_attention_mask=False, verbose=False)["input_ids"]

    def __call__(self, chunk):
        """{key: (ids int32 back to back, lengths)} for the non-empty documents of `chunk`."""
        out = {}
        for key in self.keys:
            texts = [doc[key] for doc in chunk if doc[key]]
            ids = self._ids(texts) if texts else []
            if self.append_eod:
                ids = [seq + [self.eos] for seq in ids]
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            flat = np.fromiter((t for seq in ids for t in seq), dtype=np.int32, count=int(lengths.sum()))
            out[key] = flat, lengths
        return out


def encoder_spec(tok, name):
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return ("backend", backend.to_str(), tok.eos_token_id)
    return ("name", name, tok.eos_token_id)


def _init_worker(spec, keys, append_eod):
    global _ENCODER
    _ENCODER = _Encoder(spec, keys, append_eod)


def _encode(chunk):
    return _ENCODER(chunk)


def _chunks(docs, shard):
    """Shard i of N takes documents i, i+N, i+2N, ... (balanced even for a few large documents)."""
    index, n = shard
    chunk, chars = [], 0
    for number, doc in enumerate(docs):
        if number % n != index:
            continue
        chunk.append(doc)
        chars += sum(len(t) for t in doc.values())
        if len(chunk) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


# -- the run ----------------------------------------------------------------------------------
def preprocess(input_path, prefix, *, json_keys=("text",), tokenizer=None, workers=1,
               append_eod=False, shard=None, overwrite=False, show_progress=True, log=print) -> dict:
    """Returns {key: {"prefix", "documents", "tokens"}} plus "seconds". Raises DataError."""
    from mtds.data.tokenizer import load_tokenizer
    if workers < 1:
        raise DataError(f"--workers must be >= 1, got {workers}")
    keys = list(dict.fromkeys(json_keys))
    shard = shard or (0, 1)
    tok = load_tokenizer(tokenizer)   # validates it before any worker starts
    spec = encoder_spec(tok, tokenizer)
    dtype = dtype_for_vocab(len(tok))
    prefixes = {k: output_prefix(prefix, k, shard) for k in keys}
    for p in prefixes.values():
        check_free(p, overwrite)
    docs = iter_documents(input_path, keys)

    start = time.perf_counter()
    writers = {k: IndexedWriter(p, dtype) for k, p in prefixes.items()}
    pool = None
    try:
        if workers > 1:
            import multiprocessing
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # no Rust thread pool in forks
            pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (spec, keys, append_eod))
            results = _ordered(pool, _chunks(docs, shard), 2 * workers)
        else:
            encoder = _Encoder(spec, keys, append_eod)
            results = map(encoder, _chunks(docs, shard))
        _write_all(results, writers, keys[0], show_progress)
        if writers[keys[0]].num_documents == 0 and shard[1] == 1:
            raise DataError(f"input {str(input_path)!r} holds no text under {keys[0]!r}; nothing written")
        for w in writers.values():
            w.finish()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    seconds = time.perf_counter() - start
    summary = {k: {"prefix": prefixes[k], "documents": writers[k].num_documents,
                   "tokens": writers[k].num_tokens} for k in keys}
    for k in keys:
        s = summary[k]
        log(f"{s['prefix']}: {s['documents']:,} documents, {s['tokens']:,} tokens ({dtype}) in "
            f"{seconds:.1f} s, {s['tokens'] / max(seconds, 1e-9):,.0f} tokens/s")
    summary["seconds"] = seconds
    return summary


def _ordered(pool, chunks, in_flight):
    """pool.imap would read the whole input ahead; this keeps `in_flight` chunks queued at most."""
    pending = collections.deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_encode, (chunk,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _write_all(results, writers, first_key, show_progress):
    from tqdm import tqdm
    with tqdm(unit="tok", unit_scale=True, desc="tokenizing", disable=not show_progress,
              mininterval=1.0) as bar:
        for encoded in results:
            for key, (flat, lengths) in encoded.items():
                writers[key].add_documents(flat, lengths)
            bar.update(len(encoded[first_key][0]))
            bar.set_postfix(docs=f"{writers[first_key].num_documents:,}", refresh=False)


def merge_shards(prefix, *, json_keys=("text",), overwrite=False, log=print) -> dict:
    """Join PREFIX_{key}_document.shard-i-of-N (all i) into PREFIX_{key}_document."""
    out = {}
    for key in dict.fromkeys(json_keys):
        base = output_prefix(prefix, key)
        found = glob.glob(glob.escape(base) + ".shard-*-of-*.idx")
        counts = {int(m.group(1)) for m in (re.search(r"-of-(\d+)\.idx$", f) for f in found) if m}
        if len(counts) != 1:
            raise DataError(f"no shards of {base} to merge" if not counts else
                            f"shards of {base} disagree on N ({sorted(counts)}); remove the stale ones")
        n = counts.pop()
        shards = [output_prefix(prefix, key, (i, n)) for i in range(n)]
        missing = [s for s in shards if not os.path.exists(idx_path(s))]
        if missing:
            raise DataError(f"cannot merge {base}: shard {missing[0]} is missing (run mtds-preprocess "
                            f"--shard {shards.index(missing[0])}/{n} first)")
        check_free(base, overwrite)
        merged = merge_indexed(shards, base)
        log(f"{base}: merged {n} shards, {merged.num_documents:,} documents, {merged.num_tokens:,} tokens")
        out[key] = {"prefix": base, "documents": merged.num_documents, "tokens": merged.num_tokens}
    return out


__all__ = ["preprocess", "merge_shards", "parse_shard", "output_prefix", "IndexedDataset"]
