"""A host copy of a state to be saved (--async-save): what DeepSpeed hands its checkpoint engine, with every
tensor copied off the live training state, so that the next steps may change the weights while a background
writer saves the copy.

On CUDA the copies go to pinned host memory with ``non_blocking=True`` (the step does not wait for them);
:func:`wait_copies` makes the writer wait for them (an event recorded after the last copy). On CPU a tensor's
copy is a plain ``clone``. Everything else (ints, strings, DeepSpeed's small objects) is deep-copied, so a
later change to the live object cannot reach the saved one.
"""
from __future__ import annotations

import copy

import torch


def to_host(obj):
    """``obj`` with every tensor copied to host memory (dicts, lists and tuples walked; the rest deep-copied)."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            return obj.detach().clone()
        out = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=True)
        return out.copy_(obj.detach(), non_blocking=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)         # a subclass (OrderedDict) keeps its type
        for k, v in obj.items():
            out[k] = to_host(v)
        return out
    if isinstance(obj, list):
        return [to_host(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(to_host(v) for v in obj)
    return copy.deepcopy(obj)


def copies_done_event():
    """An event after the last device-to-host copy queued on this device (None on CPU: copies are done)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        event = torch.cuda.Event()
        event.record()
        return event
    return None


def nbytes(obj) -> int:
    """Bytes of the tensors in a captured state (the host memory one snapshot holds)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0
