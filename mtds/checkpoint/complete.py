"""Which checkpoints are complete, and why the others are not.

A save (mtds.checkpoint.lifecycle.save, mtds.checkpoint.writer) goes through a staging folder
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
import heapq
import json
import os
import re
from dataclasses import dataclass

from mtds.checkpoint.durable import crc32_of
from mtds.checkpoint.safe_load import UnreadableFileError, safe_load, verify_loadable

from mtds.checkpoint.errors import CheckpointFormatError
from mtds.checkpoint.meta import META_FILE

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


def list_files(tag_dir: str) -> tuple[Marker, dict[str, tuple[int, int | None]]]:
    """The cheap half of :func:`check_complete` (marker, meta file, every rank manifest, every listed file
    present with its size): {file name: (size, CRC-32)} of the checkpoint. Tensor files nobody listed
    are included with CRC None: they must still pass the safe unpickler before DeepSpeed's loader sees
    them. Raises :class:`IncompleteCheckpoint`."""
    marker = read_marker(tag_dir)
    if not os.path.isfile(os.path.join(tag_dir, META_FILE)):
        raise IncompleteCheckpoint(f"{tag_dir}: missing {META_FILE} (partial checkpoint)")
    files: dict[str, tuple[int, int | None]] = {}
    for rank in range(marker.world_size):
        path = rank_manifest(tag_dir, rank)
        if not os.path.isfile(path):
            raise IncompleteCheckpoint(f"{tag_dir}: missing rank file {os.path.basename(path)} (rank {rank} did not "
                                       f"finish its part)")
        try:
            listed = safe_load(path)["files"]
        except (UnreadableFileError, KeyError, TypeError) as err:
            raise IncompleteCheckpoint(f"{tag_dir}: unreadable rank file {os.path.basename(path)}: "
                                       f"{str(err).splitlines()[0]}") from None
        for name, (size, crc) in listed.items():
            file = os.path.join(tag_dir, name)
            if not os.path.isfile(file):
                raise IncompleteCheckpoint(f"{tag_dir}: missing file {name} (written by rank {rank})")
            if os.path.getsize(file) != size:
                raise IncompleteCheckpoint(f"{tag_dir}: {name} has {os.path.getsize(file)} bytes, rank {rank} wrote "
                                           f"{size} (truncated or overwritten)")
            files[name] = (size, crc)
    manifests = {os.path.basename(rank_manifest(tag_dir, r)) for r in range(marker.world_size)}
    for path in glob.glob(os.path.join(tag_dir, "*.pt")):
        name = os.path.basename(path)
        if name not in files and name not in manifests:
            files[name] = (os.path.getsize(path), None)
    return marker, files


def verify_contents(tag_dir: str, files: dict[str, tuple[int, int | None]]) -> None:
    """The expensive half: each file's CRC-32 against its manifest, and each tensor file through the safe
    unpickler. Raises :class:`IncompleteCheckpoint` (corrupt) or ``UnsafeCheckpointError`` (would run
    code)."""
    for name, (_, crc) in sorted(files.items()):
        if crc is not None and crc32_of(os.path.join(tag_dir, name)) != crc:
            raise IncompleteCheckpoint(f"{tag_dir}: {name} does not match its CRC-32 (corrupt on disk)")
    try:
        verify_loadable([os.path.join(tag_dir, name) for name in sorted(files) if name.endswith(".pt")])
    except UnreadableFileError as err:
        raise IncompleteCheckpoint(f"{tag_dir}: unreadable tensor file: {err}") from None


def share(files: dict[str, tuple[int, int | None]], rank: int, world: int) -> dict[str, tuple[int, int | None]]:
    """Rank ``rank``'s part of verifying ``files`` among ``world`` ranks: largest file first to the rank
    with the fewest bytes so far (ties: lowest rank), so every file is read once and no rank reads more
    than total/world + the largest file. The same on every rank (a function of the listing only)."""
    loads = [(0, r) for r in range(world)]          # heap of (bytes assigned, rank)
    mine = {}
    for name in sorted(files, key=lambda n: (-files[n][0], n)):
        load, owner = heapq.heappop(loads)
        if owner == rank:
            mine[name] = files[name]
        heapq.heappush(loads, (load + files[name][0], owner))
    return mine


def check_complete(tag_dir: str, *, deep: bool = True) -> Marker:
    """Raise :class:`IncompleteCheckpoint` unless ``tag_dir`` is a complete checkpoint. ``deep`` also
    re-reads every file (size, CRC-32) and unpickles each with the safe loader (one process; a training
    run splits that work over its ranks instead, see ``mtds.checkpoint.lifecycle``)."""
    marker, files = list_files(tag_dir)
    if deep:
        verify_contents(tag_dir, files)
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


def newest_listed(root: str, rejected: dict[str, str] | None = None) -> tuple[str, list[str], dict]:
    """(tag folder, one line per newer checkpoint skipped, its :func:`list_files`) of the newest checkpoint
    under ``root`` that passes the cheap checks and is not in ``rejected`` ({tag folder: why}, from a
    content check). ``root`` may also be a tag folder itself: then exactly that checkpoint."""
    rejected = rejected or {}
    root = os.path.expanduser(os.fspath(root))
    if not os.path.isdir(root):
        raise CheckpointFormatError(f"checkpoint directory {root!r} does not exist")
    if _TAG.match(os.path.basename(os.path.normpath(root))) or os.path.isfile(os.path.join(root, MARKER)):
        if root in rejected:
            raise IncompleteCheckpoint(rejected[root])
        return root, [], list_files(root)[1]
    tags = tags_newest_first(root)
    if not tags:
        raise CheckpointFormatError(f"{root!r} is not an mtds checkpoint: it holds no global_stepN/ folder "
                                    f"(pass the directory given to --save, or a global_stepN folder in it)")
    skipped: list[str] = []
    for _, name in tags:
        tag_dir = os.path.join(root, name)
        try:
            if tag_dir in rejected:
                raise IncompleteCheckpoint(rejected[tag_dir])
            return tag_dir, skipped, list_files(tag_dir)[1]
        except IncompleteCheckpoint as err:
            skipped.append(f"skipped {name}: {str(err).split(': ', 1)[-1]}")
    raise IncompleteCheckpoint(f"no complete checkpoint in {root!r}: " + "; ".join(skipped))


# What a save writes into the --save directory before its checkpoint is complete: the staging folder, and
# DeepSpeed's recovery scripts (copied there by ZeRO saves).
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def start_or_resume(path: str) -> str | None:
    """What ``--load PATH`` means, decided before anything is set up: None to resume (the newest
    checkpoint passes the cheap checks), or one line saying why the run starts from scratch instead:
    PATH does not exist, is empty, or holds only what an unfinished first save left. So the same
    ``--save D --load D`` starts a job and restarts it (Megatron's behaviour). Raises
    :class:`CheckpointFormatError` where PATH is a file, holds other things but no checkpoint (probably
    not the --save directory), names a missing global_stepN folder, or holds no complete checkpoint."""
    return _resume_target(path)[0]


def _resume_target(path: str) -> tuple[str | None, str | None]:
    """(:func:`start_or_resume`'s line, None) or (None, the tag folder the cheap checks pick)."""
    root = os.path.expanduser(os.fspath(path))
    if not os.path.exists(root):
        if _TAG.match(os.path.basename(os.path.normpath(root))):
            raise CheckpointFormatError(f"checkpoint {root!r} does not exist: check --load (pass the directory "
                                        f"given to --save, or a global_stepN folder that is in it)")
        return f"--load {path}: the directory does not exist yet, no checkpoint to resume: starting from scratch", None
    if not os.path.isdir(root):
        raise CheckpointFormatError(f"--load {path!r} is a file, not a checkpoint directory: pass the directory "
                                    f"given to --save")
    entries = os.listdir(root)
    names = sorted(n for n in entries if not n.startswith("."))
    if not names:
        what = "is empty" if not entries else "holds only hidden files"
        return f"--load {path}: the directory {what}, no checkpoint to resume: starting from scratch", None
    is_tag = _TAG.match(os.path.basename(os.path.normpath(root))) or os.path.isfile(os.path.join(root, MARKER))
    if not is_tag and not tags_newest_first(root):
        staging = [n for n in names if n.endswith(STAGING_SUFFIX) and _TAG.match(n[:-len(STAGING_SUFFIX)])]
        if staging and all(n in staging or n in RECOVERY_SCRIPTS for n in names):
            return (f"--load {path}: holds only an unfinished save ({', '.join(staging)}), no complete checkpoint: "
                    f"starting from scratch"), None
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise CheckpointFormatError(
            f"{root!r} is not an mtds checkpoint: it holds {len(names)} entr{'y' if len(names) == 1 else 'ies'} "
            f"({shown}) but no global_stepN/ folder, so it is probably not the directory given to --save: pass "
            f"that one (or a global_stepN folder in it); only a missing or empty --load directory starts from "
            f"scratch")
    # the cheap checks (marker, manifests, sizes); the contents are verified on load
    return None, newest_listed(root)[0]


@dataclass(frozen=True)
class LoadPlan:
    """What ``--load PATH`` means for a run, read once by one rank before anything is set up (the run's
    other ranks get it by broadcast): start from scratch (the line saying why), an error (one line), or the
    checkpoint to resume and the model its mtds_meta.json records (None where that file cannot be read:
    the load itself then says why)."""
    fresh_start: str | None = None
    error: str | None = None
    tag_dir: str | None = None
    model: dict | None = None


def plan_load(path: str) -> LoadPlan:
    """:class:`LoadPlan` of ``--load PATH``: :func:`start_or_resume`'s decision and its checkpoint's model, in
    one pass over PATH."""
    from mtds.checkpoint.meta import CheckpointMeta
    try:
        line, tag_dir = _resume_target(path)
    except ValueError as err:      # CheckpointFormatError, IncompleteCheckpoint
        return LoadPlan(error=str(err).strip().splitlines()[0])
    if line is not None:
        return LoadPlan(fresh_start=line)
    try:
        meta = CheckpointMeta.load(tag_dir)
        return LoadPlan(tag_dir=tag_dir, model=meta.model)
    except ValueError:
        return LoadPlan(tag_dir=tag_dir)


def find_complete(root: str) -> tuple[str, list[str]]:
    """(tag folder of the newest complete checkpoint under ``root``, one line per newer one skipped), every
    file verified by this process. ``root`` may also be a tag folder itself: then exactly that
    checkpoint, if complete."""
    rejected: dict[str, str] = {}
    while True:
        tag_dir, skipped, files = newest_listed(root, rejected)
        try:
            verify_contents(tag_dir, files)
            return tag_dir, skipped
        except IncompleteCheckpoint as err:
            rejected[tag_dir] = str(err)


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


def resolve_tag_dir(path: str) -> str:
    """A checkpoint root (holding global_stepN/ folders) -> its newest complete checkpoint; a tag folder ->
    itself if complete. Anything else is a one-line CheckpointFormatError."""
    return find_complete(path)[0]
