"""The common state of a torch_dist checkpoint (the non-tensor state: ``args``, ``iteration``, ...) read
without running code, wherever the Megatron version put it:

- ``common.pt`` beside the DCP files (Megatron-core up to 0.16: ``dist_checkpointing.save`` wrote it);
- inside the DCP files as the ShardedObject ``common_state`` (0.17 on; Megatron-core's
  ``load_common_state_dict``): stored as a pickled one-item list under the key ``common_state/shard_0_1``.
  DCP's own loader unpickles such bytes with ``weights_only=False``; here the raw bytes are taken instead
  (dist_ckpt.read_bytes) and unpickled as ``common.pt`` is.

Megatron-LM pickles its whole argparse.Namespace, whose values include its own enums, functions and
dtypes. torch's ``weights_only`` unpickler refuses any class not allowed by name; here every class the file
names (``torch.serialization.get_unsafe_globals_in_checkpoint``) except Namespace is allowed *as an opaque
stub*: it is never imported or called, its arguments are kept but mean nothing, and the plain fields a
model needs (ints, floats, strings, bools) read as saved.
"""
from __future__ import annotations

import argparse
import io
import os
from typing import Any

import torch

from mtds.megatron.dist_ckpt import COMMON_KEY, read_bytes
from mtds.megatron.errors import MegatronCheckpointError

COMMON_FILE = "common.pt"


class Opaque:
    """Stands for a class or function of the pickle that is not imported (an enum member, a function)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"Opaque{self.args!r}"


def read_common(tag_dir: str, object_keys=()) -> dict[str, Any]:
    """The common state, with ``args`` (if any) as a plain dict; ``object_keys``: the DCP's non-tensor keys
    (dist_ckpt.object_keys), where 0.17+ keeps it. {} where neither holds it (Megatron-core alone)."""
    path = os.path.join(tag_dir, COMMON_FILE)
    if os.path.isfile(path):
        state = _unpickle(path, path)
    elif COMMON_KEY in object_keys:
        where = f"{tag_dir} ({COMMON_KEY})"
        state = _unpickle(io.BytesIO(read_bytes(tag_dir, COMMON_KEY)), where)
        if not (isinstance(state, list) and len(state) == 1):
            raise MegatronCheckpointError(f"{where} holds a {type(state).__name__}, not Megatron-core's "
                                          f"one-item list")
        state, path = state[0], where
    else:
        return {}
    if not isinstance(state, dict):
        raise MegatronCheckpointError(f"{path} holds a {type(state).__name__}, not a dict")
    args = state.get("args")
    if isinstance(args, argparse.Namespace):
        state["args"] = vars(args)
    return state


def _unpickle(source, where: str):
    """torch's weights_only unpickler, every class the pickle names but Namespace an opaque stub."""
    try:
        unknown = [name for name in torch.serialization.get_unsafe_globals_in_checkpoint(source)
                   if name != "argparse.Namespace"]
        if hasattr(source, "seek"):
            source.seek(0)
        # A subclass per name: the unpickler looks the stub up by the name it stands for.
        stubs = [(type(name.rpartition(".")[2], (Opaque,), {}), name) for name in unknown]
        with torch.serialization.safe_globals([argparse.Namespace, *stubs]):
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:   # noqa: BLE001 -- any unreadable file is one error line
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        # torch blocks some modules (os, subprocess, ...) even as stubs: name what the pickle asked for
        why = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else type(err).__name__)
        raise MegatronCheckpointError(f"cannot read {where}: {why}") from None
