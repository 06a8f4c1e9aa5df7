"""A Megatron-LM torch_dist checkpoint folder, read and written through torch.distributed.checkpoint.

Layout (megatron/training/checkpointing.py, megatron/core/dist_checkpointing):
    ROOT/latest_checkpointed_iteration.txt     the iteration number, or "release"
    ROOT/iter_0000100/metadata.json            {"sharded_backend": "torch_dist", ...}
    ROOT/iter_0000100/common.pt                args, iteration, ... (common.py); from Megatron-core 0.17 on
                                               inside the DCP files instead, under COMMON_KEY
    ROOT/iter_0000100/.metadata, __R_N.distcp  torch.distributed.checkpoint: every tensor at its global shape

Tensors go through DCP's own FileSystemReader/FileSystemWriter in one process (``no_dist``): reading a
key into a tensor of its global shape gathers every shard Megatron's ranks wrote, whatever their (t, p).
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Any, Mapping

import torch

from mtds.megatron.errors import MegatronCheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
CONFIG = "metadata.json"
# Where Megatron-core 0.17+ keeps the common state: ShardedObject("common_state", global shape (1,),
# offset (0,)), a pickled one-item list (common.py reads it).
COMMON_KEY = "common_state/shard_0_1"


@contextlib.contextmanager
def _one_process():
    """DCP warns that it runs without a process group: that is the intent here (one process reads or
    writes every shard)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def iteration_dir(root: str, iteration: int | str) -> str:
    return os.path.join(root, "release" if iteration == "release" else f"iter_{int(iteration):07d}")


def resolve_dir(path: str) -> str:
    """The iteration folder of ``path``: itself when it holds metadata.json, else the tracker's iteration."""
    if os.path.isfile(os.path.join(path, CONFIG)):
        return path
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker):
        raise MegatronCheckpointError(f"{path} is not a Megatron checkpoint: no {CONFIG} and no {TRACKER}")
    with open(tracker) as f:
        text = f.read().strip()
    if text != "release" and not text.isdigit():
        raise MegatronCheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration number")
    where = iteration_dir(path, text)
    if not os.path.isfile(os.path.join(where, CONFIG)):
        raise MegatronCheckpointError(f"{where} has no {CONFIG}: not a torch_dist checkpoint (Megatron-LM's "
                                      f"--ckpt-format torch_dist), or incomplete")
    return where


def check_backend(tag_dir: str) -> None:
    with open(os.path.join(tag_dir, CONFIG)) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as err:
            raise MegatronCheckpointError(f"{tag_dir}/{CONFIG} is not JSON: {err}") from None
    backend = config.get("sharded_backend")
    if backend != "torch_dist":
        raise MegatronCheckpointError(f"{tag_dir} is a {backend!r} checkpoint; only torch_dist is read (convert "
                                      f"it with Megatron-LM's --ckpt-convert-format torch_dist)")


def _tensor_metadata(tag_dir: str) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    try:
        metadata = FileSystemReader(tag_dir).read_metadata()
    except Exception as err:   # noqa: BLE001 -- a missing or corrupt .metadata is one error line
        raise MegatronCheckpointError(f"cannot read the tensor index of {tag_dir}: {err}") from None
    return {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}


def object_keys(tag_dir: str) -> set[str]:
    """Keys of the non-tensor entries (ShardedObjects, stored as pickled bytes)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    try:
        metadata = FileSystemReader(tag_dir).read_metadata()
    except Exception as err:   # noqa: BLE001
        raise MegatronCheckpointError(f"cannot read the tensor index of {tag_dir}: {err}") from None
    return {k for k, m in metadata.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}


def read_bytes(tag_dir: str, key: str) -> bytes:
    """The raw stored bytes of one non-tensor entry: DCP's default planner would unpickle them with
    ``weights_only=False`` (running whatever code the pickle names); this one keeps them as bytes."""
    import torch.distributed.checkpoint as dcp

    got: dict[str, bytes] = {}

    class _RawBytes(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            got[read_item.dest_index.fqn] = value.read()
    with _one_process():
        dcp.load({key: b""}, storage_reader=dcp.FileSystemReader(tag_dir), no_dist=True,
                 planner=_RawBytes(flatten_state_dict=False))
    if key not in got:
        raise MegatronCheckpointError(f"{tag_dir}: DCP returned no bytes for {key}")
    return got[key]


def tensor_shapes(tag_dir: str) -> dict[str, tuple[int, ...]]:
    """{key: global shape} of every tensor (ShardedObjects, stored as bytes, are left out)."""
    return {k: tuple(m.size) for k, m in _tensor_metadata(tag_dir).items()}


def load_tensors(tag_dir: str, keys: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """{key: full tensor, in its stored dtype} of ``keys`` ({key: global shape}), read by DCP into tensors of
    that shape."""
    import torch.distributed.checkpoint as dcp
    dtypes = {k: m.properties.dtype for k, m in _tensor_metadata(tag_dir).items()}
    state = {k: torch.empty(shape, dtype=dtypes[k]) for k, shape in keys.items()}
    with _one_process():
        dcp.load(state, storage_reader=dcp.FileSystemReader(tag_dir), no_dist=True)
    return state


def write(root: str, iteration: int, tensors: Mapping[str, torch.Tensor], common: Mapping[str, Any],
          objects: Mapping[str, Any] = (), *, common_inside: bool = False) -> str:
    """ROOT/iter_XXXXXXX as Megatron-LM writes it; ``objects``: ShardedObjects by their stored key. The
    common state goes to ``common.pt``, which every Megatron-core version reads (0.17+ as its legacy
    layout), or with ``common_inside`` into the DCP files as 0.17+ writes it. Returns the iteration folder."""
    import torch.distributed.checkpoint as dcp
    where = iteration_dir(root, iteration)
    os.makedirs(where, exist_ok=True)
    state: dict[str, Any] = dict(tensors)
    # DCP pickles a non-tensor value itself; Megatron-core stores under each ShardedObject key the list of
    # the rank's objects (_mcore_to_torch_sharded_object) and unpacks that list on load.
    state.update({key: [obj] for key, obj in dict(objects).items()})
    if common_inside:
        state[COMMON_KEY] = [dict(common)]
    with _one_process():
        # Unflattened, as Megatron-core writes: flattening would store each list's items under "<key>.0".
        dcp.save(state, storage_writer=dcp.FileSystemWriter(where), no_dist=True,
                 planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    if not common_inside:
        torch.save(dict(common), os.path.join(where, "common.pt"))
    with open(os.path.join(where, CONFIG), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(iteration))
    return where
