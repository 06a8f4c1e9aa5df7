"""What a data file holds, for cache keys: never its path or mtime, so touching a file, copying it
or mounting it elsewhere keeps the key, and changing its content changes it.

Files up to ``WHOLE_FILE_BYTES`` are hashed whole; larger ones by their size and ``SAMPLED_BLOCKS``
blocks spread over them plus the last block (a few MB read whatever the size: an edit that keeps the
size and falls between the blocks goes unseen -- rename or touch the cache away in that case).
"""
from __future__ import annotations

import hashlib
import os

WHOLE_FILE_BYTES = 64 << 20
SAMPLED_BLOCKS, BLOCK = 32, 1 << 16


def file_digest(path: str) -> str:
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            for k in range(SAMPLED_BLOCKS):
                f.seek(k * (size - BLOCK) // (SAMPLED_BLOCKS - 1))
                h.update(f.read(BLOCK))
    return h.hexdigest()[:24]


def files_identity(files, root: str) -> list:
    """[[path relative to ``root`` (it orders the documents), size, content digest], ...]."""
    root = os.path.abspath(root)
    return [[os.path.relpath(os.path.abspath(f), root), os.path.getsize(f), file_digest(f)] for f in files]
