"""A host copy of a state to be saved (--async-save): what DeepSpeed hands its checkpoint engine, with every
tensor copied off the live training state, so that the next steps may change the weights while a background
writer saves the copy.

On CUDA (:func:`to_host`) the copies go to pinned host memory with ``non_blocking=True`` (the step does not wait
for them); the writer thread waits on an event recorded after the last copy (:func:`copies_done_event`). On CPU
(:class:`Packed`) each file's tensors are copied into one shared-memory buffer for the writer process
(mtds.checkpoint.writer_process). Everything else (ints, strings, DeepSpeed's small objects) is deep-copied, so
a later change to the live object cannot reach the saved one.
"""
from __future__ import annotations

import copy
import os

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
    if isinstance(obj, Packed):
        return obj.nbytes
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


class _Slot:
    """Where tensor ``index`` of a packed state goes."""
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __reduce__(self):
        return _Slot, (self.index,)


def _map_leaves(obj, leaf):
    """``obj`` with dicts (their own type kept), lists and plain tuples rebuilt and ``leaf`` applied to the rest."""
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _map_leaves(v, leaf)
        return out
    if isinstance(obj, list):
        return [_map_leaves(v, leaf) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map_leaves(v, leaf) for v in obj)
    return leaf(obj)


class Packed:
    """One file's state for the writer process: its tensors copied into one shared-memory buffer (one file
    descriptor to hand over, whatever the number of tensors), the rest of the state with slots in their place."""

    def __init__(self, state):
        tensors: list[torch.Tensor] = []

        def strip(obj):
            if isinstance(obj, torch.Tensor):
                tensors.append(obj.detach())
                return _Slot(len(tensors) - 1)
            return copy.deepcopy(obj)

        self.skeleton = _map_leaves(state, strip)
        self.slots, offset = [], 0
        for t in tensors:
            self.slots.append((offset, t.dtype, tuple(t.shape)))
            offset += -(-t.numel() * t.element_size() // 64) * 64      # 64-byte aligned: any dtype's view fits
        self.nbytes = offset
        self.fd = os.memfd_create("mtds-checkpoint", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, max(offset, 1))
        self.buffer = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=max(offset, 1), dtype=torch.uint8)
        for t, (start, _, _) in zip(tensors, self.slots):
            if t.numel():
                self._view(start, t.dtype, t.shape).copy_(t)

    def __getstate__(self):           # the buffer travels as its descriptor, beside the pickle
        return {"skeleton": self.skeleton, "slots": self.slots, "nbytes": self.nbytes}

    def __setstate__(self, state):
        self.__dict__.update(state, fd=None, buffer=None)

    def attach(self, fd: int) -> None:
        """The writer's side: map the buffer received as ``fd``."""
        self.buffer = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=max(self.nbytes, 1),
                                      dtype=torch.uint8)

    def release(self) -> None:
        """The trainer's side, once handed over: drop its mapping and descriptor."""
        self.buffer = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _view(self, start: int, dtype, shape) -> torch.Tensor:
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        return self.buffer[start:start + n].view(dtype).view(shape)

    def unpack(self):
        """The state with each tensor in its own storage (what the synchronous save writes)."""
        tensors = [self._view(start, dtype, shape).clone() for start, dtype, shape in self.slots]

        return _map_leaves(self.skeleton, lambda obj: tensors[obj.index] if isinstance(obj, _Slot) else obj)
