"""Megatron's indexed dataset format: the layout of `PREFIX.idx` (facts only).

`PREFIX.bin` is the token ids of every sequence, back to back, in one dtype.
`PREFIX.idx` is little-endian:

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code of the .bin (table below)
    uint64    S = number of sequences
    uint64    D = number of entries in the document index
    int32[S]  sequence lengths (tokens)
    int64[S]  sequence pointers (byte offset of each sequence in the .bin)
    int64[D]  document index: sequence numbers where documents start/end, 0 first, S last

A document is one or more consecutive sequences (Megatron splits sentences into
sequences only with --split-sentences); mtds writes one sequence per document, so
its document index is 0, 1, ..., S.
"""
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")   # magic, version, dtype code, S, D
HEADER_SIZE = HEADER.size           # 34 bytes

DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


def dtype_for_vocab(vocab_size: int):
    """uint16 when every id fits (vocab <= 65536), else int32: halves the .bin of small vocabularies."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)


def pack_header(dtype, num_sequences: int, num_doc_entries: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, CODE_OF[np.dtype(dtype)], num_sequences, num_doc_entries)


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"
