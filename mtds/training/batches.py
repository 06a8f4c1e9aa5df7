"""Micro-batches to the device without a host sync per micro-batch.

``tensor.to(cuda)`` from pageable host memory is synchronous: the host waits for the copy, once per
micro-batch. On CUDA, :class:`DeviceBatches` pins each batch and copies it with ``non_blocking`` on a
side stream while the current micro-batch computes, one micro-batch ahead. It never reads past the end
of the step (the stream's position is what a checkpoint saves), so a step's first micro-batch is the one
copy the host waits for. On CPU it passes batches through unchanged.
"""
from __future__ import annotations

import torch


class DeviceBatches:
    """``stream``'s micro-batches as device tensors; ``count``: how many this step reads, so prefetching
    stops there (reading on past it works, without prefetch)."""

    def __init__(self, stream, device: torch.device, count: int, *, prefetch: bool | None = None):
        self.stream, self.device, self.left = stream, device, count
        self.prefetch = device.type == "cuda" if prefetch is None else prefetch
        self.copy_stream = torch.cuda.Stream(device) if self.prefetch and device.type == "cuda" else None
        self.ready = None

    def __iter__(self):
        return self

    def _fetch(self):
        batch = next(self.stream)
        self.left -= 1
        if self.copy_stream is None:
            return tuple(t.to(self.device) for t in batch)
        with torch.cuda.stream(self.copy_stream):
            return tuple(t.pin_memory().to(self.device, non_blocking=True) for t in batch)

    def __next__(self):
        if self.ready is None:
            self.ready = self._fetch()       # the step's first micro-batch (or one more than counted)
        batch, self.ready = self.ready, None
        if self.copy_stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.copy_stream)
            for t in batch:
                t.record_stream(current)     # the side stream's allocation is used on this one
        if self.prefetch and self.left > 0:
            self.ready = self._fetch()       # the next micro-batch of this step copies meanwhile
        return batch
