"""Sample indices built once per node and shared through the filesystem, never a timed collective.

One process per node (local rank 0) builds a directory of .npy files under a temporary name and
renames it into place; the others wait for that directory to appear, logging progress, and fail
with one line naming the path if the builder failed or died (same host: its pid is gone) or after
`timeout` seconds. A finished directory is reused by later runs with the same key.
"""
import hashlib
import json
import os
import shutil
import socket
import time

import numpy as np

from mtds.data.errors import DataError

_SAMPLED_BLOCKS, _BLOCK = 16, 1 << 16


def prefix_identity(dataset) -> dict:
    """Content, not path or mtime: sizes, the header and sampled blocks of the .idx (cheap on a
    GB-sized index, and a copy or a new mount point keeps the key)."""
    idx = dataset.prefix + ".idx"
    size = os.path.getsize(idx)
    h = hashlib.sha256()
    with open(idx, "rb") as f:
        for k in range(_SAMPLED_BLOCKS + 1):
            f.seek(min(size, k * size // _SAMPLED_BLOCKS))
            h.update(f.read(_BLOCK))
        f.seek(max(0, size - _BLOCK))
        h.update(f.read())
    return {"idx_size": size, "bin_size": os.path.getsize(dataset.prefix + ".bin"), "sampled": h.hexdigest()[:20]}


def cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def load_or_build(directory: str, build, *, builder: bool, log=print, timeout: float = 3600.0,
                  poll: float = 0.2) -> dict:
    """{name: array} of `directory`'s .npy files (memory-mapped) plus its meta.json as "meta".
    `build()` returns ({name: array}, meta) and runs only where `builder` is true."""
    if not os.path.exists(os.path.join(directory, "meta.json")):
        if builder:
            _build_index_files(directory, build)
        else:
            _wait(directory, log, timeout, poll)
    with open(os.path.join(directory, "meta.json")) as f:
        out = {"meta": json.load(f)}
    for name in out["meta"]["arrays"]:
        out[name] = np.load(os.path.join(directory, name + ".npy"), mmap_mode="r")
    return out


def _marker(directory: str, kind: str) -> str:
    return directory.rstrip("/") + f".{kind}"


def _build_index_files(directory: str, build) -> None:
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    with open(_marker(directory, "building"), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
    if os.path.exists(_marker(directory, "failed")):
        os.remove(_marker(directory, "failed"))
    tmp = f"{directory}.tmp-{os.getpid()}"
    try:
        arrays, meta = build()
        os.makedirs(tmp, exist_ok=True)
        for name, array in arrays.items():
            np.save(os.path.join(tmp, name + ".npy"), array)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(dict(meta, arrays=sorted(arrays)), f)
        try:
            os.rename(tmp, directory)
        except OSError:   # another node's builder got there first with the same content
            if not os.path.exists(os.path.join(directory, "meta.json")):
                raise
    except BaseException as exc:
        with open(_marker(directory, "failed"), "w") as f:
            f.write(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(_marker(directory, "building")):
            os.remove(_marker(directory, "building"))


def _wait(directory: str, log, timeout: float, poll: float) -> None:
    start = time.time()
    last_log = start
    meta = os.path.join(directory, "meta.json")
    while not os.path.exists(meta):
        failed = _marker(directory, "failed")
        if os.path.exists(failed) and os.path.getmtime(failed) >= start - 1:
            with open(failed) as f:
                raise DataError(f"building {directory} failed on the building rank: {f.read().strip()}")
        if _builder_died(_marker(directory, "building")) and not os.path.exists(meta):
            raise DataError(f"the process building {directory} died before finishing; delete "
                            f"{_marker(directory, 'building')} and start again")
        now = time.time()
        if now - start > timeout:
            raise DataError(f"waited {timeout:.0f} s for {directory} to be built by local rank 0 of this "
                            f"node; is the cache directory shared and writable? (MTDS_DATA_CACHE)")
        if now - last_log >= 30:
            log(f"data: waiting for {directory} ({now - start:.0f} s; local rank 0 builds it)")
            last_log = now
        time.sleep(poll)


def _builder_died(marker: str) -> bool:
    try:
        with open(marker) as f:
            who = json.load(f)
    except (OSError, ValueError):
        return False
    if who.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(who["pid"]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
