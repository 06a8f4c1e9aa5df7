"""Megatron-compatible indexed datasets: PREFIX.bin (token ids) + PREFIX.idx (index).

    with IndexedWriter("data/corpus", dtype_for_vocab(len(tok))) as w:
        w.add_document(ids)
    ds = IndexedDataset("data/corpus")      # memory-mapped; ds[i] -> numpy ids of sequence i

Files are read and written byte-compatibly with megatron-core's IndexedDataset /
IndexedDatasetBuilder (tests/test_indexed_format.py checks both directions).
"""
from mtds.data.indexed.format import bin_path, dtype_for_vocab, idx_path
from mtds.data.indexed.reader import IndexedDataset
from mtds.data.indexed.writer import IndexedWriter, merge_indexed

__all__ = ["IndexedDataset", "IndexedWriter", "merge_indexed", "dtype_for_vocab", "bin_path", "idx_path"]
