"""Which checkpoints are complete, and why the others are not.

A save (mtds.training.checkpoint.save, mtds.reshard.writer) goes through a staging folder
``global_stepN.partial``: every rank writes and fsyncs its files and a manifest
``mtds_rank_RRRRR.pt`` (each file's size and CRC-32, plus that rank's RNG states); after a barrier
rank 0 writes ``mtds_meta.json`` and then the completion marker ``mtds_complete.json`` (written last,
fsynced with its folder), renames the folder to ``global_stepN`` and only then moves ``latest``.

So a folder ``global_stepN`` with a marker whose every rank manifest and listed file checks out is
complete; anything else is skipped with one line saying why. Loading never trusts ``latest``: a crash
between the rename and the update of ``latest`` must not hide the newest complete checkpoint.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass

from mtds.safety.durable import crc32_of
from mtds.safety.loading import UnreadableFileError, safe_load, verify_loadable

from .errors import CheckpointFormatError
from .meta import META_FILE

MARKER = "mtds_complete.json"
STAGING_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"     # a complete checkpoint of the same step, while a new one takes its name
CHECKPOINT_FORMAT = 2          # 1: before markers and manifests (mtds <= 0.1), refused with a clear line
_TAG = re.compile(r"^global_step(\d+)(\.replaced)?$")


def rank_manifest(tag_dir: str, rank: int) -> str:
    return os.path.join(tag_dir, f"mtds_rank_{rank:05d}.pt")


class IncompleteCheckpoint(CheckpointFormatError):
    """One checkpoint folder that must not be loaded; the message says why in one line."""


@dataclass
class Marker:
    step: int
    world_size: int            # number of rank manifests
    format: int = CHECKPOINT_FORMAT

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "world_size": self.world_size, "format": self.format,
                           "written_by": "mtds"}, indent=2)


def read_marker(tag_dir: str) -> Marker:
    path = os.path.join(tag_dir, MARKER)
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(tag_dir, META_FILE)) and not glob.glob(rank_manifest(tag_dir, 0)):
            raise IncompleteCheckpoint(f"{tag_dir}: saved by an older mtds (checkpoint format 1, no completion "
                                       f"marker): resume it with that mtds version, or convert its weights with "
                                       f"that version's mtds-convert mtds-to-hf and start with --init-from-hf")
        raise IncompleteCheckpoint(f"{tag_dir}: missing completion marker {MARKER} (the save did not finish)")
    try:
        with open(path) as f:
            d = json.load(f)
        marker = Marker(step=int(d["step"]), world_size=int(d["world_size"]), format=int(d.get("format", 0)))
    except (ValueError, KeyError, TypeError) as err:
        raise IncompleteCheckpoint(f"{tag_dir}: unreadable completion marker ({type(err).__name__})") from None
    if marker.format != CHECKPOINT_FORMAT:
        raise IncompleteCheckpoint(f"{tag_dir}: checkpoint format {marker.format}, but this mtds reads format "
                                   f"{CHECKPOINT_FORMAT}: use the mtds version that saved it")
    return marker


def check_complete(tag_dir: str, *, deep: bool = True) -> Marker:
    """Raise :class:`IncompleteCheckpoint` unless ``tag_dir`` is a complete checkpoint. ``deep`` also
    re-reads every file (size, CRC-32) and unpickles each with the safe loader."""
    marker = read_marker(tag_dir)
    if not os.path.isfile(os.path.join(tag_dir, META_FILE)):
        raise IncompleteCheckpoint(f"{tag_dir}: missing {META_FILE} (partial checkpoint)")
    listed: set[str] = set()
    for rank in range(marker.world_size):
        path = rank_manifest(tag_dir, rank)
        if not os.path.isfile(path):
            raise IncompleteCheckpoint(f"{tag_dir}: missing rank file {os.path.basename(path)} (rank {rank} did not "
                                       f"finish its part)")
        try:
            files = safe_load(path)["files"]
        except (UnreadableFileError, KeyError, TypeError) as err:
            raise IncompleteCheckpoint(f"{tag_dir}: unreadable rank file {os.path.basename(path)}: "
                                       f"{str(err).splitlines()[0]}") from None
        for name, (size, crc) in files.items():
            listed.add(name)
            file = os.path.join(tag_dir, name)
            if not os.path.isfile(file):
                raise IncompleteCheckpoint(f"{tag_dir}: missing file {name} (written by rank {rank})")
            if os.path.getsize(file) != size:
                raise IncompleteCheckpoint(f"{tag_dir}: {name} has {os.path.getsize(file)} bytes, rank {rank} wrote "
                                           f"{size} (truncated or overwritten)")
            if deep and crc32_of(file) != crc:
                raise IncompleteCheckpoint(f"{tag_dir}: {name} does not match its CRC-32 (corrupt on disk)")
    if deep:
        try:
            verify_loadable(sorted(glob.glob(os.path.join(tag_dir, "*.pt"))))
        except UnreadableFileError as err:
            raise IncompleteCheckpoint(f"{tag_dir}: unreadable tensor file: {err}") from None
    return marker


def tags_newest_first(root: str) -> list[tuple[int, str]]:
    """(step, folder name) of every ``global_stepN`` folder, newest first; ``global_stepN.replaced``
    only where a crash left no ``global_stepN`` (staging folders are never candidates)."""
    names = set(os.listdir(root))
    found = []
    for name in names:
        m = _TAG.match(name)
        if m and os.path.isdir(os.path.join(root, name)) and not (m.group(2) and name[:-len(m.group(2))] in names):
            found.append((int(m.group(1)), name))
    return sorted(found, reverse=True)


def find_complete(root: str) -> tuple[str, list[str]]:
    """(tag folder of the newest complete checkpoint under ``root``, one line per newer one skipped).

    ``root`` may also be a tag folder itself: then exactly that checkpoint, if complete."""
    root = os.path.expanduser(os.fspath(root))
    if not os.path.isdir(root):
        raise CheckpointFormatError(f"checkpoint directory {root!r} does not exist")
    if _TAG.match(os.path.basename(os.path.normpath(root))) or os.path.isfile(os.path.join(root, MARKER)):
        check_complete(root)
        return root, []
    tags = tags_newest_first(root)
    if not tags:
        raise CheckpointFormatError(f"{root!r} is not an mtds checkpoint: it holds no global_stepN/ folder "
                                    f"(pass the directory given to --save, or a global_stepN folder in it)")
    skipped: list[str] = []
    for _, name in tags:
        tag_dir = os.path.join(root, name)
        try:
            check_complete(tag_dir)
            return tag_dir, skipped
        except IncompleteCheckpoint as err:
            skipped.append(f"skipped {name}: {str(err).split(': ', 1)[-1]}")
    raise IncompleteCheckpoint(f"no complete checkpoint in {root!r}: " + "; ".join(skipped))


def complete_tags(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints (marker present: cheap check), newest first; used to prune old ones."""
    out = []
    for step, name in tags_newest_first(root):
        try:
            read_marker(os.path.join(root, name))
            out.append((step, name))
        except IncompleteCheckpoint:
            pass
    return out
