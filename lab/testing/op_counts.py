"""Counts a test can hold so per-step overhead cannot creep back unseen (issue 21): host reads of device
values, and tensor copies, by ATen operator.

* :class:`HostReads` counts the points where the host waits for a tensor's value: ``item()`` /
  ``float()`` / ``bool()`` / ``int()`` (all dispatch ``aten::_local_scalar_dense``) and ``tolist()``
  (which reads the storage without dispatching on CPU; counted by wrapping it while active). On a GPU each
  is a device synchronisation; on CPU each is where a rank's host logic waits on its numbers.
* :class:`OpCounts` counts every ATen operator run (forward and, on CPU, backward: the autograd engine
  runs CPU backward on the calling thread) under a ``TorchDispatchMode``; :data:`COPIES` names the ones
  that copy a whole tensor (``clone``, ``contiguous`` of a strided view, ``copy_``, ``cat``, casts).

Collectives are counted by :class:`mtds.observe.comm_trace.CommTracer`. Tests count; they never time.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COPIES = ("aten.clone.default", "aten.copy_.default", "aten.cat.default", "aten._to_copy.default")


class OpCounts(TorchDispatchMode):
    """``with OpCounts() as ops: ...``; ``ops.counts["aten.clone.default"]``, ``ops.copies()``."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def copies(self) -> dict[str, int]:
        return {name: self.counts[name] for name in COPIES if self.counts[name]}


class HostReads(TorchDispatchMode):
    """``with HostReads() as reads: ...``; ``reads.count``: host reads of tensor values in the block."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._tolist = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        reads, tolist = self, torch.Tensor.tolist
        self._tolist = tolist

        def counted_tolist(tensor):
            reads.count += 1
            return tolist(tensor)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
