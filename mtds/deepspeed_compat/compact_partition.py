"""ZeRO-1's compact gradient partition, laid out once and cut in two operators a step.

DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer._build_compact_grad_partition_buffer`` makes the flat gradient
partition its step reads (a ``GradPartitionBufferGroup``: the flat tensor plus one view per parameter piece
and padding run, which its norm and overflow check iterate) anew each step: a ``zeros``, a ``narrow`` and a
``view`` per parameter, then every view's offset and shape read back -- 2 operators and ~10 Python calls per
parameter per step (100 parameters at bench_host's shape: 200 views). The layout cannot change while the
optimizer's partitioning does not, so :class:`CompactPartition` reads it from one DeepSpeed build and then
makes each step's group with one ``empty`` and one ``split_with_sizes``:

* ``empty``, not ``zeros``: mtds's reduce-scatter (zero1_reduce.py) writes every element of the partition,
  padding included (its fill zeroes what no gradient covers) -- one memset of Ψ/d fp32 less a step;
* the pieces are 1-D: their readers (the norm, the overflow check, the step's flatten) read them flat;
  the recorded view specs (shapes included) are DeepSpeed's own, for ``move_flat_partition``.

``ALLOC`` allocates the flat partition (a test poisons it with NaN to prove every element is written).
"""
from __future__ import annotations

import torch

ALLOC = torch.empty


class CompactPartition:
    """Parameter group ``i``'s partition layout of ``opt`` (DeepSpeed's ZeRO-1/2 optimizer)."""

    def __init__(self, opt, i: int):
        reference = opt._build_compact_grad_partition_buffer(i)
        flat = reference.flat_partition
        self.size, self.dtype, self.device = flat.numel(), flat.dtype, flat.device
        self.sizes = [piece.numel() for piece in reference]
        self.padding = [k for k, piece in enumerate(reference) if getattr(piece, "_zero_padding", False)]
        self.specs = list(reference._view_specs)
        self.group_type = type(reference)
        at = 0
        for (offset, _, _), n in zip(self.specs, self.sizes):      # the pieces tile the partition in order
            if offset != at:
                raise RuntimeError(f"ZeRO-1 partition {i}: DeepSpeed's pieces do not tile it (offset {offset}, "
                                   f"expected {at})")
            at += n
        if at != self.size:
            raise RuntimeError(f"ZeRO-1 partition {i}: DeepSpeed's pieces cover {at} of {self.size} elements")

    def build(self):
        """A fresh group: the flat partition (contents undefined until the reduce-scatter writes them) and
        its pieces as views."""
        flat = ALLOC(self.size, dtype=self.dtype, device=self.device)
        pieces = list(flat.split(self.sizes))
        for k in self.padding:
            pieces[k]._zero_padding = True
        group = self.group_type.__new__(self.group_type)
        list.__init__(group, pieces)
        group.flat_partition, group._view_specs = flat, self.specs
        return group
