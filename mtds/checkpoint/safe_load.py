"""``torch.load`` that cannot run code: ``weights_only=True`` plus an explicit allow-list.

A ``.pt`` file is a pickle, and unpickling may call any importable function (``os.system`` included).
torch's ``weights_only`` unpickler only rebuilds tensors and plain containers, and whatever classes
are allowed by name. DeepSpeed's checkpoint files need exactly the classes in :func:`allowed_globals`
(found by listing the globals of checkpoints saved with ZeRO-0/1/2/3, fp32/bf16/fp16, with and
without a pipeline, and of their universal conversions); anything else is refused with a line that
names the class, before a single object of the file is built.
"""
from __future__ import annotations

import os
import pickle
import re

import torch


class UnsafeCheckpointError(ValueError):
    """A file that would need a class outside the allow-list."""


class UnreadableFileError(ValueError):
    """Not a readable torch file: truncated, corrupt, or something else entirely."""


def allowed_globals() -> list:
    """Classes DeepSpeed pickles into checkpoints besides tensors and containers."""
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, SubparamShape]


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|global ([\w.]+)|Unsupported operand|function ([\w.]+)")


def _refused_name(err: Exception) -> str:
    text = str(err)
    for match in _GLOBAL.finditer(text):
        name = next((g for g in match.groups() if g), None)
        if name:
            return name
    return text.strip().splitlines()[-1][:120] if text.strip() else type(err).__name__


def safe_load(path: str | os.PathLike, *, map_location="cpu", mmap: bool = False, allowed: list | None = None):
    """``torch.load(path, weights_only=True)`` with mtds's allow-list (or ``allowed``: ``[]`` for HF
    weights, which are tensors only); a one-line error otherwise."""
    path = os.fspath(path)
    try:
        with torch.serialization.safe_globals(allowed_globals() if allowed is None else allowed):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"refusing to load {path}: it needs {_refused_name(err)}, which is not a type mtds or DeepSpeed "
            f"checkpoints hold (unpickling it could run arbitrary code); only load checkpoints you trust, "
            f"re-saved by mtds") from None
    except FileNotFoundError:
        raise
    except (RuntimeError, OSError, EOFError, ValueError) as err:   # truncated zip, not a torch file, ...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnreadableFileError(f"cannot read {path}: {type(err).__name__}: {first} (truncated or corrupt "
                                    f"file)") from None


def verify_loadable(paths) -> None:
    """Unpickle every file with :func:`safe_load` (memory-mapped, so tensor bytes stay on disk) before
    code that uses a plain ``torch.load`` (DeepSpeed's loaders and converters) touches any of them."""
    for path in paths:
        try:
            safe_load(path, mmap=True)
        except UnreadableFileError as err:
            if "mmap" not in str(err):
                raise
            safe_load(path)        # files in torch's legacy (non-zip) format cannot be memory-mapped
