"""Memory-mapped reader of a Megatron indexed dataset (PREFIX.bin + PREFIX.idx).

Opening one reads the 34-byte header and maps both files; the index arrays are
views on the mapped .idx and the tokens are read from the mapped .bin only when
a sequence is asked for, so start-up cost does not grow with the corpus.
"""
import mmap
import os

import numpy as np

from mtds.data.errors import DataError
from mtds.data.indexed.format import DTYPE_CODES, HEADER, HEADER_SIZE, MAGIC, VERSION, bin_path, idx_path


class IndexedDataset:
    """`ds[i]` is sequence i as a read-only numpy view of the .bin (the index's dtype).

    Attributes: ids (the whole .bin, memory-mapped), dtype, sequence_lengths (int32[S]), sequence_pointers (int64[S]),
    document_indices (int64[D]), num_tokens.
    """

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        idx, binf = idx_path(self.prefix), bin_path(self.prefix)
        for path in (idx, binf):
            if not os.path.isfile(path):
                raise DataError(f"indexed dataset {self.prefix!r}: {path} does not exist; pass the "
                                f"prefix without .bin/.idx (mtds-preprocess writes PREFIX.bin and PREFIX.idx)")
        size = os.path.getsize(idx)
        if size < HEADER_SIZE:
            raise DataError(f"{idx} is not a Megatron index: {size} bytes, shorter than its header")
        with open(idx, "rb") as f:
            magic, version, code, n_seq, n_doc = HEADER.unpack(f.read(HEADER_SIZE))
        if magic != MAGIC:
            raise DataError(f"{idx} is not a Megatron index (magic {magic!r}, expected {MAGIC!r}); "
                            f"write it with mtds-preprocess or Megatron's preprocess_data.py")
        if version != VERSION:
            raise DataError(f"{idx} has index version {version}; only version {VERSION} is supported")
        if code not in DTYPE_CODES:
            raise DataError(f"{idx} names an unknown token dtype code {code}")
        need = HEADER_SIZE + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if size < need:
            raise DataError(f"{idx} is truncated: {size} bytes, its header needs {need}; "
                            f"re-run the preprocessing")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self._idx = np.memmap(idx, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, n_seq, HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, n_seq, HEADER_SIZE + 4 * n_seq)
        self.document_indices = np.frombuffer(self._idx, np.int64, n_doc, HEADER_SIZE + 12 * n_seq)

        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n_seq else 0
        bin_size = os.path.getsize(binf)
        if bin_size < end:
            raise DataError(f"{binf} is shorter than its index says ({bin_size} bytes, expected "
                            f"{end}); it was cut short — re-run the preprocessing")
        self.ids = _map_tokens(binf, self.dtype, bin_size)
        self.num_tokens = end // self.dtype.itemsize

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return max(0, len(self.document_indices) - 1)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length=None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (to its end when length is None)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        stop = start - offset + int(self.sequence_lengths[i]) if length is None else start + length
        return self.ids[start:stop]

    def document_lengths(self) -> np.ndarray:
        """Tokens per document (sums its sequences), int64[num_documents]."""
        bounds = np.cumsum(self.sequence_lengths, dtype=np.int64)
        ends = np.concatenate([[0], bounds])[self.document_indices]
        return np.diff(ends)


def _map_tokens(path: str, dtype, size: int) -> np.ndarray:
    """The .bin as a read-only array. Samples are read at random places: MADV_RANDOM keeps the kernel
    from reading ahead (up to MBs per 2 KB sample otherwise: slower, and it fills the process's RSS)."""
    if size == 0:   # an empty file cannot be mapped; nothing would be read from it anyway
        return np.zeros(0, dtype)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(buf, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        buf.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(buf, dtype=dtype, count=size // dtype.itemsize)
