"""Counts a test can hold so per-step overhead cannot creep back unseen (issue 21): host reads of device
values, and tensor copies, by ATen operator.

* :class:`HostReads` counts the points where the host waits for a tensor's value: ``item()`` /
  ``float()`` / ``bool()`` / ``int()`` (all dispatch ``aten::_local_scalar_dense``) and ``tolist()``
  (which reads the storage without dispatching on CPU; counted by wrapping it while active). On a GPU each
  is a device synchronisation; on CPU each is where a rank's host logic waits on its numbers.
* :class:`OpCounts` counts every ATen operator run (forward and, on CPU, backward: the autograd engine
  runs CPU backward on the calling thread) under a ``TorchDispatchMode``; :data:`COPIES` names the ones
  that copy a whole tensor (``clone``, ``contiguous`` of a strided view, ``copy_``, ``cat``, casts).
  torch.compile'd code runs compiled under it (``ignore_compile_internals``): what such code dispatches is
  counted, its own kernels are not ATen operators -- :class:`CompiledGraphs` counts those.
* :class:`CompiledGraphs` reads each Inductor graph run in a block off its generated code: its kernels and
  the buffers it allocates.

Collectives are counted by :class:`mtds.observe.comm_trace.CommTracer`. Tests count; they never time.
"""
from __future__ import annotations

import re
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

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Else Dynamo runs compiled functions eagerly under the mode -- and keeps doing so for their code
        # after it (torch 2.13): the count would be of code the run never runs.
        return True

    def copies(self) -> dict[str, int]:
        return {name: self.counts[name] for name in COPIES if self.counts[name]}


class CompiledGraphs:
    """``with CompiledGraphs() as graphs: ...``: the Inductor graphs run in the block, read off their generated
    code (static shapes): ``graphs.runs``, ``graphs.kernels`` (kernel calls: ``cpp_*`` on CPU, ``triton_*`` on
    CUDA; extern kernels such as a GEMM are ATen operators, which :class:`OpCounts` counts) and
    ``graphs.buffers``, the (shape, dtype) of every tensor the runs allocate. A dispatch mode sees none of
    these: they happen inside the graph's code."""

    _KERNEL = re.compile(r"^\s+((?:cpp|triton)_\w+)(?:\.run)?\(", re.M)
    _BUFFER = re.compile(r"= empty_strided_\w+\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)")

    def __enter__(self):
        from torch._inductor.output_code import CompiledFxGraph
        self.runs, self.kernels, self.buffers = 0, 0, []
        self._original = original = CompiledFxGraph.__call__
        watch = self

        def call(graph, inputs):
            code = graph.source_code
            body = code[code.index("def call("):]
            watch.runs += 1
            watch.kernels += len(self._KERNEL.findall(body))
            watch.buffers += [(tuple(int(d) for d in shape.split(",") if d.strip()), getattr(torch, dtype))
                              for shape, dtype in self._BUFFER.findall(body)]
            return original(graph, inputs)

        CompiledFxGraph.__call__ = call
        return self

    def __exit__(self, *exc):
        from torch._inductor.output_code import CompiledFxGraph
        CompiledFxGraph.__call__ = self._original
        return False


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

    ignore_compile_internals = OpCounts.ignore_compile_internals

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
