"""Rank 0's half of a crash-safe save: make a fully written staging folder the checkpoint, move
``latest``, prune old checkpoints -- each step ordered so that a crash at any point leaves every
complete checkpoint intact and loadable (see complete.py for the format)."""
from __future__ import annotations

import os
import shutil

import torch

from mtds.checkpoint.durable import crc32_of, fsync_dir, fsync_file, write_atomic

from mtds.checkpoint.complete import MARKER, REPLACED_SUFFIX, Marker, complete_tags, rank_manifest
from mtds.checkpoint.meta import LATEST, CheckpointMeta
from mtds.checkpoint.universal import universal_dir


def describe_files(staging_dir: str, names) -> dict[str, tuple[int, int]]:
    """{name: (size, CRC-32)} of files already written, fsyncing each."""
    files = {}
    for name in names:
        path = os.path.join(staging_dir, name)
        fsync_file(path)
        files[name] = (os.path.getsize(path), crc32_of(path))
    return files


def write_manifest(staging_dir: str, rank: int, files: dict[str, tuple[int, int]], rng: dict | None = None) -> None:
    """Rank ``rank``'s manifest: the files it wrote (already fsynced) with size and CRC-32, and its RNG."""
    path = rank_manifest(staging_dir, rank)
    torch.save({"rank": rank, "files": files, "rng": rng}, path)
    fsync_file(path)


def commit(root: str, tag: str, staging_dir: str, marker: Marker, meta: CheckpointMeta | None) -> str:
    """Staging folder (every rank's files and manifests fsynced) -> ``root/tag``; returns that path."""
    if meta is not None:
        meta.save(staging_dir)
    write_atomic(os.path.join(staging_dir, MARKER), marker.to_json())     # last file of the checkpoint
    final = os.path.join(root, tag)
    # A universal conversion of an older checkpoint of this step would no longer match it.
    shutil.rmtree(universal_dir(root, tag), ignore_errors=True)
    if os.path.exists(final):
        # Same step saved again (a resumed run): the old one stays loadable as tag.replaced until
        # the new one has its name (complete.py looks there when tag is missing).
        aside = final + REPLACED_SUFFIX
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        fsync_dir(root)
        os.rename(staging_dir, final)
        fsync_dir(root)
        shutil.rmtree(aside)
    else:
        os.rename(staging_dir, final)
        fsync_dir(root)
    write_atomic(os.path.join(root, LATEST), tag)      # for DeepSpeed's tools; mtds does not need it
    return final


def prune(root: str, keep_last: int) -> list[str]:
    """Delete complete checkpoints beyond the newest ``keep_last`` (call after a commit); their names."""
    removed = []
    for _, name in complete_tags(root)[keep_last:]:
        shutil.rmtree(universal_dir(root, name), ignore_errors=True)
        shutil.rmtree(os.path.join(root, name))
        removed.append(name)
    if removed:
        fsync_dir(root)
    return removed
