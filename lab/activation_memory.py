"""What autograd keeps for backward: bytes of the tensors saved while a function runs forward.

Counts each storage once (views of one tensor share it) and leaves out parameters, which are not
activations. Uses ``torch.autograd.graph.saved_tensors_hooks``, so it sees every tensor an op saves,
including the inputs ``torch.utils.checkpoint`` keeps, and not the ones a checkpoint drops.

``float_bytes`` counts floating-point elements at that size instead of their dtype's, so an fp32 run
on a CPU can be read in the 16-bit bytes Korthikanti et al. (2022) use; other dtypes (bool masks)
keep their own size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch


@dataclass(frozen=True)
class SavedTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int            # of the whole storage, counted as asked (see float_bytes)


def saved_tensors(fn: Callable[..., Any], *args: Any, exclude: Iterable[torch.Tensor] = (),
                  float_bytes: int | None = None) -> tuple[Any, list[SavedTensor]]:
    """Run ``fn(*args)``; return its output and one record per distinct storage saved for backward."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, SavedTensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in skip and key not in seen:
            nbytes = storage.nbytes()
            if float_bytes is not None and tensor.is_floating_point():
                nbytes = nbytes // tensor.element_size() * float_bytes
            seen[key] = SavedTensor(tuple(tensor.shape), tensor.dtype, nbytes)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn(*args)
    return out, list(seen.values())


def saved_bytes(fn: Callable[..., Any], *args: Any, exclude: Iterable[torch.Tensor] = (),
                float_bytes: int | None = None) -> tuple[Any, int]:
    """``fn``'s output and the bytes of everything saved for its backward."""
    out, records = saved_tensors(fn, *args, exclude=exclude, float_bytes=float_bytes)
    return out, sum(r.nbytes for r in records)
