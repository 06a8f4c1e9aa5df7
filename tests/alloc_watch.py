"""The largest tensor a piece of code allocates, by watching every aten op it runs (CPU has no
allocator statistics): an op's output whose storage is none of its inputs' is a new allocation."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LargestAllocation(TorchDispatchMode):
    """``with LargestAllocation() as watch: ...``; then ``watch.elements``: the most elements of one new
    tensor storage (0 if none), and ``watch.op``: the op that made it."""

    def __init__(self):
        super().__init__()
        self.elements, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                elements = t.untyped_storage().nbytes() // t.element_size()
                if elements > self.elements:
                    self.elements, self.op = elements, str(func)
        return result
