"""``common.pt`` of a torch_dist checkpoint (the non-tensor state: ``args``, ``iteration``, ...) read
without running code.

Megatron-LM pickles its whole argparse.Namespace, whose values include its own enums, functions and
dtypes. torch's ``weights_only`` unpickler refuses any class not allowed by name; here every class the file
names (``torch.serialization.get_unsafe_globals_in_checkpoint``) except Namespace is allowed *as an opaque
stub*: it is never imported or called, its arguments are kept but mean nothing, and the plain fields a
model needs (ints, floats, strings, bools) read as saved.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

import torch

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


def read_common(tag_dir: str) -> dict[str, Any]:
    """The common state, with ``args`` (if any) as a plain dict."""
    path = os.path.join(tag_dir, COMMON_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        unknown = [name for name in torch.serialization.get_unsafe_globals_in_checkpoint(path)
                   if name != "argparse.Namespace"]
        # A subclass per name: the unpickler looks the stub up by the name it stands for.
        stubs = [(type(name.rpartition(".")[2], (Opaque,), {}), name) for name in unknown]
        with torch.serialization.safe_globals([argparse.Namespace, *stubs]):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:   # noqa: BLE001 -- any unreadable file is one error line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MegatronCheckpointError(f"cannot read {path}: {first}") from None
    if not isinstance(state, dict):
        raise MegatronCheckpointError(f"{path} holds a {type(state).__name__}, not a dict")
    args = state.get("args")
    if isinstance(args, argparse.Namespace):
        state["args"] = vars(args)
    return state
