"""Micro-batches reach the device in order, and prefetching never reads past the step's last micro-batch
(the data stream's position is what a checkpoint saves). On CPU the prefetch path is forced on; the
copy itself is a CUDA side-stream copy only on GPUs."""
from __future__ import annotations

import torch

from mtds.training.batches import DeviceBatches


class _Stream:
    def __init__(self):
        self.reads = 0

    def __next__(self):
        self.reads += 1
        return torch.full((2, 3), self.reads), torch.full((2, 3), -self.reads)


def test_prefetch_stays_inside_the_step_and_keeps_order():
    stream = _Stream()
    batches = DeviceBatches(stream, torch.device("cpu"), 4, prefetch=True)
    seen = []
    for i in range(4):
        inputs, labels = next(batches)
        seen.append(int(inputs[0, 0]))
        assert int(labels[0, 0]) == -seen[-1]
        assert stream.reads == min(i + 2, 4), (i, stream.reads)     # one ahead, never past the 4th
    assert seen == [1, 2, 3, 4]
    assert int(next(batches)[0][0, 0]) == 5 and stream.reads == 5    # asked for more: read, not prefetched


def test_without_prefetch_each_read_is_on_demand():
    stream = _Stream()
    batches = DeviceBatches(stream, torch.device("cpu"), 3)
    next(batches)
    assert stream.reads == 1
