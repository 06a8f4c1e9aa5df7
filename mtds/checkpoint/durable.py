"""Writes that survive a crash: fsync files and the directories naming them, atomic replacement.

A file is on disk only after ``fsync`` of the file, and its *name* only after ``fsync`` of its
directory; ``os.replace`` switches a name from the old file to the new one atomically.
"""
from __future__ import annotations

import os
import zlib


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes | str) -> None:
    """Write ``path`` so that a crash leaves either the old content or the new, never a mix."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def crc32_of(path: str, chunk: int = 1 << 22) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


class DurableCheckpointEngine:
    """Wraps a DeepSpeed checkpoint engine: every file it saves is fsynced and recorded (name, size,
    CRC-32) so the rank can list what it wrote; every file it loads goes through the safe loader."""

    def __init__(self, inner):
        self._inner = inner
        self.written: dict[str, tuple[int, int]] = {}
        # --async-save: while a list, save() takes a host copy of each file's state here (made by
        # ``snapshot``) instead of writing it (mtds.checkpoint.async_save writes them later, off the training thread)
        self.captured: list[tuple[str, object]] | None = None
        self.snapshot = None

    def __getattr__(self, name):           # create/commit/makedirs/... unchanged
        return getattr(self._inner, name)

    def save(self, state_dict, path: str):
        if self.captured is not None:
            self.captured.append((path, self.snapshot(state_dict)))
            return None
        return self.write(state_dict, path)

    def write(self, state_dict, path: str):
        """Write, fsync and record one file (the engine's own save, on any thread)."""
        result = self._inner.save(state_dict, path)
        fsync_file(path)
        self.written[os.path.abspath(path)] = (os.path.getsize(path), crc32_of(path))
        return result

    def load(self, path: str, map_location=None):
        from mtds.checkpoint.safe_load import safe_load
        return safe_load(path, map_location=map_location if map_location is not None else "cpu")
