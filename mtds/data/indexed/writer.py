"""Streaming writer of Megatron's indexed format, and merging of several into one.

Tokens go straight to a temporary .bin and the per-sequence lengths and document
boundaries to two small temporary side files, so memory stays bounded by the
batch being added, never by the corpus. `finish()` writes the .idx from the side
files in chunks and renames: the .bin first, the .idx last, so a PREFIX.idx
exists only for a complete dataset (an interrupted run leaves temporaries, which
`abort()` or the next run removes, and no index to be read).
"""
import os
import shutil

import numpy as np

from mtds.data.errors import DataError
from mtds.data.indexed.format import bin_path, idx_path, pack_header
from mtds.data.indexed.reader import IndexedDataset

_CHUNK = 1 << 20   # index entries per write when building the .idx


class IndexedWriter:
    """with IndexedWriter(prefix, dtype) as w: w.add_document(ids) ...  (one sequence per document)

    Leaving the block normally calls finish(); leaving it with an exception calls abort().
    """

    def __init__(self, prefix: str, dtype):
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        info = np.iinfo(self.dtype)
        self._lo, self._hi = info.min, info.max
        tag = f".tmp-{os.getpid()}"
        self._tmp = {name: self.prefix + f".{name}{tag}" for name in ("bin", "len", "doc", "idx")}
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        self._files = {name: open(self._tmp[name], "wb") for name in ("bin", "len", "doc")}
        self.num_sequences = self.num_documents = self.num_tokens = 0

    # -- adding ------------------------------------------------------------------------------
    def add_document(self, ids) -> None:
        self.add_documents(np.asarray(ids), np.array([len(ids)]))

    def add_documents(self, flat, lengths) -> None:
        """Several one-sequence documents at once: `flat` holds them back to back."""
        flat, lengths = np.asarray(flat), np.asarray(lengths, dtype=np.int64)
        if flat.size and (flat.min() < self._lo or flat.max() > self._hi):
            bad = flat.max() if flat.max() > self._hi else flat.min()
            raise DataError(f"token id {bad} does not fit the {self.dtype} of {self.prefix}.bin; "
                            f"the tokenizer's vocabulary is larger than the dtype chosen for it")
        if int(lengths.sum()) != flat.size:
            raise ValueError("lengths do not add up to the tokens given")
        self._files["bin"].write(flat.astype(self.dtype, copy=False).tobytes())
        self._files["len"].write(lengths.astype(np.int32).tobytes())
        ends = self.num_sequences + np.arange(1, len(lengths) + 1, dtype=np.int64)
        self._files["doc"].write(ends.tobytes())
        self.num_sequences += len(lengths)
        self.num_documents += len(lengths)
        self.num_tokens += flat.size

    def add_index(self, prefix: str) -> None:
        """Append a whole indexed dataset (the merge step): its bytes and its document boundaries."""
        src = IndexedDataset(prefix)
        if src.dtype != self.dtype:
            raise DataError(f"cannot merge {prefix} ({src.dtype}) into {self.prefix} ({self.dtype}): "
                            f"the shards were written with different tokenizers")
        base = self.num_sequences
        for start in range(0, len(src), _CHUNK):
            self._files["len"].write(np.asarray(src.sequence_lengths[start:start + _CHUNK]).tobytes())
        for start in range(1, len(src.document_indices), _CHUNK):
            self._files["doc"].write((src.document_indices[start:start + _CHUNK] + base).tobytes())
        with open(bin_path(prefix), "rb") as f:
            _copy_bytes(f, self._files["bin"], src.num_tokens * self.dtype.itemsize)
        self.num_sequences += len(src)
        self.num_documents += src.num_documents
        self.num_tokens += src.num_tokens

    # -- ending ------------------------------------------------------------------------------
    def finish(self) -> None:
        for f in self._files.values():
            f.close()
        n_seq, n_doc = self.num_sequences, self.num_documents + 1
        with open(self._tmp["idx"], "wb") as out:
            out.write(pack_header(self.dtype, n_seq, n_doc))
            with open(self._tmp["len"], "rb") as f:
                shutil.copyfileobj(f, out)
            lengths = np.memmap(self._tmp["len"], dtype=np.int32, mode="r") if n_seq else np.zeros(0, np.int32)
            carry = 0   # byte offset of the chunk's first sequence
            for start in range(0, n_seq, _CHUNK):
                nbytes = lengths[start:start + _CHUNK].astype(np.int64) * self.dtype.itemsize
                ends = np.cumsum(nbytes) + carry
                out.write((ends - nbytes).tobytes())
                carry = int(ends[-1])
            del lengths
            out.write(np.zeros(1, np.int64).tobytes())
            with open(self._tmp["doc"], "rb") as f:
                shutil.copyfileobj(f, out)
        # A stale index of an older dataset must not pair with the new .bin, even briefly.
        if os.path.exists(idx_path(self.prefix)):
            os.remove(idx_path(self.prefix))
        os.replace(self._tmp["bin"], bin_path(self.prefix))
        os.replace(self._tmp["idx"], idx_path(self.prefix))
        self._remove_temporaries()

    def abort(self) -> None:
        for f in self._files.values():
            f.close()
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        for path in self._tmp.values():
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        else:
            self.abort()
        return False


def _copy_bytes(src, dst, count: int) -> None:
    """Only the bytes the index covers: a .bin may carry trailing bytes no sequence points to."""
    while count > 0:
        block = src.read(min(count, 16 << 20))
        if not block:
            break
        dst.write(block)
        count -= len(block)


def merge_indexed(prefixes, out_prefix: str) -> IndexedDataset:
    """Concatenate indexed datasets (e.g. the shards of `mtds-preprocess --shard i/N`) in order."""
    if not prefixes:
        raise DataError("nothing to merge: name the shard prefixes")
    first = IndexedDataset(prefixes[0])
    with IndexedWriter(out_prefix, first.dtype) as w:
        for prefix in prefixes:
            w.add_index(prefix)
    return IndexedDataset(out_prefix)
